//! Reinforcement learning with verifiable rewards ([`crate::rl`]): each step's prompts answered
//! `group_size` times by the policy, scored, and the clipped objective over the answers' tokens.
//! Every `num_iterations` steps a new generation; the steps between reuse it (their ratios against
//! the log-probabilities at generation). The evaluations answer every held-out prompt once,
//! greedily: their "loss" is the negated mean reward (so that the best checkpoint is the one with
//! the highest held-out reward), the rewards beside it.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use ember_data::prompts::Prompt;
use ember_data::Tokenizer;
use ember_kernels::TrainBackend;
use ember_model::Decoder;

use super::{Accumulation, EvalBatches, Evaluated, MicroBatches, Objective, Split};
use crate::config::{RlConfig, ScaleRewards, TrainConfig};
use crate::error::TrainError;
use crate::eval::Part;
use crate::metrics::StepRecord;
use crate::rl::reward::{Item, Rewards, Scores};
use crate::rl::rollout::{self, SampleConfig};
use crate::rl::{
    advantages, completion_logps, host_logps, policy_loss, Answers, LossConfig, LossSums, Prompts, StepTotals,
};

/// What the objective reads besides the config: the prompts, the tokenizer (answers are scored as
/// text), where rank 0 logs the rollouts, and the starting model (the KL term's reference, β > 0).
pub(crate) struct RlInputs<'a, B: TrainBackend> {
    pub(crate) prompts: &'a Prompts,
    pub(crate) tokenizer: &'a Tokenizer,
    pub(crate) rollouts: Option<PathBuf>,
    pub(crate) reference: Option<Decoder<B::InnerBackend>>,
}

/// Answers through the loss in one forward and backward pass.
const ANSWERS_PER_PASS: usize = 8;

/// Sampled answers, their texts and their scores.
struct Answered {
    sampled: rollout::Sampled,
    texts: Vec<String>,
    scores: Scores,
}

/// A generation's answers, by micro-batch, and its sums for the records.
struct Generation {
    batches: Vec<Answers>,
    sums: GenerationSums,
}

pub(crate) struct Rl<'a, B: TrainBackend> {
    config: RlConfig,
    loss: LossConfig,
    sample: SampleConfig,
    inputs: RlInputs<'a, B>,
    rewards: Rewards,
    seed: u64,
    eval: EvalBatches,
    generation: Mutex<Option<Generation>>,
}

impl<'a, B: TrainBackend> Rl<'a, B> {
    /// The objective of `run`'s `[rl]`; refuses prompts that lack a reward's column or leave no
    /// room in the model's context for `max_new_tokens`.
    pub(crate) fn new(run: &TrainConfig, config: RlConfig, inputs: RlInputs<'a, B>) -> Result<Self, TrainError> {
        let rewards = Rewards::new(&config.rewards)?;
        let context = run.model.max_seq_len;
        for p in inputs.prompts.train.iter().chain(&inputs.prompts.val) {
            if let Some((reward, column)) = rewards.missing_columns(&p.row) {
                return Err(TrainError::Rl(format!(
                    "{}:{}: the row has no column `{column}`, which reward {reward} reads",
                    p.file.display(),
                    p.line
                )));
            }
            if p.ids.len() + config.max_new_tokens > context {
                return Err(TrainError::Rl(format!(
                    "{}:{}: the prompt takes {} tokens; with rl.max_new_tokens = {} that is more than the \
                     model's context of {context} positions (shorten the prompt or lower rl.max_new_tokens)",
                    p.file.display(),
                    p.line,
                    p.ids.len(),
                    config.max_new_tokens
                )));
            }
        }
        let schema = config
            .json_schema
            .as_deref()
            .map(|path| rollout::load_schema(path, inputs.tokenizer, run.model.vocab_size))
            .transpose()?;
        Ok(Self {
            loss: LossConfig::of(&config),
            sample: SampleConfig::of(&config, inputs.tokenizer, schema),
            rewards,
            seed: run.train.seed,
            eval: EvalBatches::of(run),
            generation: Mutex::new(None),
            inputs,
            config,
        })
    }

    /// Samples, scores and turns into advantages the answers to this rank's micro-batches of
    /// `step` (`global[k]`: the step's index of the `k`-th).
    fn generate(
        &self,
        model: &Decoder<B::InnerBackend>,
        batches: &[Vec<usize>],
        global: &[usize],
        step: usize,
        c: &dyn crate::collective::Collective,
    ) -> Result<Generation, TrainError> {
        let g = self.config.group_size;
        let prompts: Vec<&Prompt> = batches.iter().flatten().map(|&i| &self.inputs.prompts.train[i]).collect();
        let mut seeds = Vec::new();
        for (k, batch) in batches.iter().enumerate() {
            for b in 0..batch.len() {
                seeds.extend((0..g).map(|j| mix(&[self.seed, step as u64, global[k] as u64, b as u64, j as u64])));
            }
        }
        let Answered { sampled, texts, scores } = self.answer(model, &prompts, g, &seeds, &self.sample)?;
        let batch_std = match self.config.scale_rewards {
            ScaleRewards::Batch => {
                let r = &scores.total;
                let mut s = [r.iter().sum::<f64>(), r.iter().map(|x| x * x).sum(), r.len() as f64];
                c.all_reduce_f64(&mut s, "rewards of the step")?;
                let n = s[2];
                if n > 1.0 {
                    ((s[1] - s[0] * s[0] / n) / (n - 1.0)).max(0.0).sqrt()
                } else {
                    0.0
                }
            }
            _ => 0.0,
        };
        let (adv, stds) = advantages(&scores.total, g, self.config.scale_rewards, batch_std);
        let sums = GenerationSums::of(&scores, &stds, &sampled.tokens, &sampled.truncated);
        if let Some(path) = self.inputs.rollouts.as_ref().filter(|_| self.logs_rollouts(step)) {
            self.log_rollouts(path, step, &prompts, g, &texts, &sampled.tokens, &scores, &adv)?;
        }

        let mut out = Vec::with_capacity(batches.len());
        let mut a = 0;
        for batch in batches {
            let n = batch.len() * g;
            let range = a..a + n;
            let mut answers = Answers {
                prompts: prompts[a / g..(a + n) / g]
                    .iter()
                    .flat_map(|p| std::iter::repeat_n(p.ids.clone(), g))
                    .collect(),
                completions: sampled.tokens[range.clone()].to_vec(),
                advantages: adv[range.clone()].to_vec(),
                masked: sampled.truncated[range].iter().map(|&t| t && self.config.mask_truncated).collect(),
                old_logps: None,
                ref_logps: None,
            };
            let t = self.config.temperature;
            if self.config.num_iterations > 1 {
                answers.old_logps = Some(host_logps(model, &answers, t));
            }
            if let Some(reference) = self.inputs.reference.as_ref().filter(|_| self.config.beta != 0.0) {
                answers.ref_logps = Some(host_logps(reference, &answers, t));
            }
            out.push(answers);
            a += n;
        }
        Ok(Generation { batches: out, sums })
    }

    fn logs_rollouts(&self, step: usize) -> bool {
        self.config.log_rollouts > 0 && (step == 1 || step % self.config.log_rollouts == 0)
    }

    /// Appends the step's answers to `rollouts.jsonl`: prompt, answer, each reward, the sum and the
    /// advantage.
    #[allow(clippy::too_many_arguments)]
    fn log_rollouts(
        &self,
        path: &std::path::Path,
        step: usize,
        prompts: &[&Prompt],
        group: usize,
        texts: &[String],
        tokens: &[Vec<u32>],
        scores: &Scores,
        adv: &[f64],
    ) -> Result<(), TrainError> {
        let names = self.rewards.names();
        let mut text = Vec::new();
        for (a, completion) in texts.iter().enumerate() {
            let p = prompts[a / group];
            let rewards: serde_json::Map<String, serde_json::Value> =
                names.iter().zip(&scores.per_reward).map(|(n, s)| (n.clone(), s[a].into())).collect();
            let line = serde_json::json!({
                "step": step,
                "line": p.line,
                "prompt": p.text,
                "completion": completion,
                "tokens": tokens[a].len(),
                "rewards": rewards,
                "reward": scores.total[a],
                "advantage": adv[a],
            });
            serde_json::to_writer(&mut text, &line).map_err(|e| TrainError::Rl(e.to_string()))?;
            text.push(b'\n');
        }
        let io = |err| TrainError::Io { path: path.to_path_buf(), err };
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(io)?;
        f.write_all(&text).map_err(io)
    }

    /// Answers each of `prompts` `group` times (the `i`-th answer's sampler seeded by `seeds[i]`)
    /// and scores the answers.
    fn answer(
        &self,
        model: &Decoder<B::InnerBackend>,
        prompts: &[&Prompt],
        group: usize,
        seeds: &[u64],
        sample: &SampleConfig,
    ) -> Result<Answered, TrainError> {
        let ids: Vec<&[u32]> = prompts.iter().flat_map(|p| std::iter::repeat_n(p.ids.as_slice(), group)).collect();
        let lines: Vec<String> = prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(format!("{}:{}", p.file.display(), p.line), group))
            .collect();
        let sampled = rollout::sample(model.clone(), &ids, seeds, &lines, sample, self.inputs.tokenizer)?;
        let texts: Vec<String> = sampled
            .tokens
            .iter()
            .map(|t| self.inputs.tokenizer.decode_skipping_special(t))
            .collect::<Result<_, _>>()?;
        let items: Vec<Item<'_>> = (0..texts.len())
            .map(|a| {
                let p = prompts[a / group];
                Item {
                    prompt: &p.text,
                    completion: &texts[a],
                    tokens: sampled.tokens[a].len(),
                    row: &p.row,
                    file: &p.file,
                    line: p.line,
                }
            })
            .collect();
        let scores = self.rewards.score(&items)?;
        Ok(Answered { sampled, texts, scores })
    }

    /// This rank's share of the held-out (or a fixed sample of the training) prompts, answered once
    /// greedily and scored: `[−Σ reward, answers, Σ tokens, Σ each reward…]`.
    fn score_split(&self, model: &Decoder<B::InnerBackend>, split: Split, part: Part) -> Result<Vec<f64>, TrainError> {
        let prompts = &self.inputs.prompts;
        let chosen: Vec<&Prompt> = match split {
            Split::Val => prompts.val.iter().collect(),
            Split::Train => {
                let e = &self.eval;
                let n = (e.iters * e.batch_size).min(prompts.train.len());
                let sampler = ember_data::WindowSampler::random(e.train_seed);
                sampler.indices(0, n, prompts.train.len()).into_iter().map(|i| &prompts.train[i]).collect()
            }
        };
        let mine: Vec<&Prompt> =
            chosen.into_iter().enumerate().filter(|(i, _)| part.keeps(*i)).map(|(_, p)| p).collect();
        let k = self.rewards.names().len();
        let mut sums = vec![0.0; 3 + k];
        if mine.is_empty() {
            return Ok(sums);
        }
        let seeds = vec![0; mine.len()];
        let Answered { sampled, scores, .. } = self.answer(model, &mine, 1, &seeds, &self.sample.greedy())?;
        sums[0] = -scores.total.iter().sum::<f64>();
        sums[1] = mine.len() as f64;
        sums[2] = sampled.tokens.iter().map(|t| t.len() as f64).sum();
        for (r, s) in scores.per_reward.iter().enumerate() {
            sums[3 + r] = s.iter().sum();
        }
        Ok(sums)
    }
}

impl<B: TrainBackend> Objective<B> for Rl<'_, B> {
    fn forward_backward(
        &self,
        model: &Decoder<B>,
        batches: MicroBatches<'_, B>,
    ) -> Result<(GradientsParams, Vec<f64>), TrainError> {
        let (rank, world) = (batches.rank, batches.world);
        let global: Vec<usize> = (rank..batches.indices.len()).step_by(world.max(1)).collect();
        let mine = batches.mine(batches.indices.clone());
        let mut held = self.generation.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = (batches.step.saturating_sub(1)) % self.config.num_iterations == 0;
        let started = std::time::Instant::now();
        if fresh || held.is_none() {
            *held = Some(self.generate(&model.valid(), &mine, &global, batches.step, batches.collective)?);
        }
        let generation_s = started.elapsed().as_secs_f64();
        let generation = held.as_ref().expect("generated above");
        let mut tokens = [generation.batches.iter().map(Answers::tokens).sum::<f64>()];
        batches.collective.all_reduce_f64(&mut tokens, "answer tokens of the step")?;
        let mut acc = Accumulation::<B>::new(batches.loss_scale);
        let mut sums = LossSums::default();
        for answers in &generation.batches {
            let totals = StepTotals::of(batches.indices.len() as f64, tokens[0], answers);
            // ANSWERS_PER_PASS answers a forward and backward pass: the `[answers · C, V]` logits
            // (with their log-softmax and its gradient) are what a pass holds most of.
            for part in answers.parts(ANSWERS_PER_PASS) {
                let (logps, entropy) = completion_logps(model, &part, self.config.temperature, batches.device);
                let out = policy_loss(&self.loss, logps, entropy, &part, totals);
                acc.report(out.loss.clone());
                sums.add(&out.sums);
                acc.backward(model, out.loss);
            }
        }
        let (loss, grads) = acc.finish();
        let mut v = vec![loss];
        let mut generated = generation.sums.to_vec();
        // The lengths' min and max: their mean over the ranks once summed.
        generated[8] /= world as f64;
        generated[9] /= world as f64;
        v.extend(generated);
        v.extend(sums.to_vec());
        // The time spent sampling and scoring answers (and the old and reference log-probabilities):
        // its mean over the ranks once summed.
        v.push(generation_s / world as f64);
        Ok((grads, v))
    }

    fn record_step(&self, sums: &[f64], record: &mut StepRecord) {
        let k = self.rewards.names().len();
        let n = GenerationSums::len(k);
        let generation = GenerationSums::from_slice(&sums[..n], k);
        record.named.extend(generation.named(&self.rewards.names()));
        record.named.extend(LossSums::from_slice(&sums[n..]).named(self.config.beta));
        record.named.insert("timing/generation_s".into(), sums[n + LossSums::LEN]);
    }

    fn evaluate(&self, model: &Decoder<B::InnerBackend>, split: Split, part: Part) -> Result<Vec<f64>, TrainError> {
        self.score_split(model, split, part)
    }

    fn evaluated(&self, sums: &[f64], split: Split) -> Evaluated {
        let n = sums[1].max(1.0);
        let reward = -sums[0] / n;
        let prefix = match split {
            Split::Val => "val_",
            Split::Train => "eval_train_",
        };
        let mut named =
            vec![(format!("{prefix}reward"), reward), (format!("{prefix}completions/mean_length"), sums[2] / n)];
        for (name, s) in self.rewards.names().iter().zip(&sums[3..]) {
            named.push((format!("{prefix}rewards/{name}/mean"), s / n));
        }
        Evaluated { loss: -reward, named, note: format!(", mean reward {reward:.4} over {} prompts (greedy)", sums[1]) }
    }
}

/// Sums over a generation of TRL's reward and completion metrics.
#[derive(Debug, Clone, Default, PartialEq)]
struct GenerationSums {
    answers: f64,
    reward: f64,
    /// Each reward's Σ and Σ².
    per_reward: Vec<[f64; 2]>,
    groups: f64,
    group_std: f64,
    zero_std_groups: f64,
    length: f64,
    truncated: f64,
    terminated_length: f64,
    min_length: f64,
    max_length: f64,
}

impl GenerationSums {
    fn len(k: usize) -> usize {
        10 + 2 * k
    }

    fn of(scores: &Scores, group_stds: &[f64], tokens: &[Vec<u32>], truncated: &[bool]) -> Self {
        let lengths: Vec<f64> = tokens.iter().map(|t| t.len() as f64).collect();
        Self {
            answers: lengths.len() as f64,
            reward: scores.total.iter().sum(),
            per_reward: scores.per_reward.iter().map(|s| [s.iter().sum(), s.iter().map(|x| x * x).sum()]).collect(),
            groups: group_stds.len() as f64,
            group_std: group_stds.iter().sum(),
            zero_std_groups: group_stds.iter().filter(|s| s.abs() < 1e-8).count() as f64,
            length: lengths.iter().sum(),
            truncated: truncated.iter().filter(|&&t| t).count() as f64,
            // A fold from +0 (an empty sum of floats is -0).
            terminated_length: lengths.iter().zip(truncated).filter(|(_, t)| !**t).fold(0.0, |s, (l, _)| s + l),
            min_length: lengths.iter().copied().fold(f64::INFINITY, f64::min),
            max_length: lengths.iter().copied().fold(0.0, f64::max),
        }
    }

    fn to_vec(&self) -> Vec<f64> {
        let mut v = vec![
            self.answers,
            self.reward,
            self.groups,
            self.group_std,
            self.zero_std_groups,
            self.length,
            self.truncated,
            self.terminated_length,
            self.min_length,
            self.max_length,
        ];
        v.extend(self.per_reward.iter().flatten());
        v
    }

    fn from_slice(s: &[f64], k: usize) -> Self {
        Self {
            answers: s[0],
            reward: s[1],
            groups: s[2],
            group_std: s[3],
            zero_std_groups: s[4],
            length: s[5],
            truncated: s[6],
            terminated_length: s[7],
            min_length: s[8],
            max_length: s[9],
            per_reward: (0..k).map(|r| [s[10 + 2 * r], s[11 + 2 * r]]).collect(),
        }
    }

    /// TRL's names. The lengths' min and max are exact on one process (the mean of the ranks' on
    /// several).
    fn named(&self, names: &[String]) -> Vec<(String, f64)> {
        let n = self.answers.max(1.0);
        let groups = self.groups.max(1.0);
        let terminated = (self.answers - self.truncated).max(1.0);
        let mut out = vec![
            ("reward".to_string(), self.reward / n),
            ("reward_std".into(), self.group_std / groups),
            ("frac_reward_zero_std".into(), self.zero_std_groups / groups),
            ("completions/mean_length".into(), self.length / n),
            ("completions/min_length".into(), self.min_length),
            ("completions/max_length".into(), self.max_length),
            ("completions/clipped_ratio".into(), self.truncated / n),
            ("completions/mean_terminated_length".into(), self.terminated_length / terminated),
        ];
        for (name, [s, sq]) in names.iter().zip(&self.per_reward) {
            let mean = s / n;
            let var = if n > 1.0 { ((sq - s * s / n) / (n - 1.0)).max(0.0) } else { 0.0 };
            out.push((format!("rewards/{name}/mean"), mean));
            out.push((format!("rewards/{name}/std"), var.sqrt()));
        }
        out
    }
}

/// A seed from several numbers (SplitMix64 over each in turn).
fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for &p in parts {
        h ^= p;
        h = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = h;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h = z ^ (z >> 31);
    }
    h
}
