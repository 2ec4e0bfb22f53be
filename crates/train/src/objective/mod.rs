//! What a step optimizes: the objective, one of the trainer's parts. The loop, the evaluator and
//! the recorder talk to it through [`Objective`]: its forward and backward passes over a step's
//! micro-batches (gradient accumulation), its evaluation of both splits, the sums the ranks add
//! (the loss first) and the names the records give them, and what it changes in the model after a
//! step. [`next_token`]: the language-modelling loss (with a mixture of experts' auxiliary losses
//! and DeepSeek's bias balancing); [`preference`]: pairs of answers (DPO, IPO, SimPO, ORPO);
//! [`rl`]: answers sampled by the policy and scored by rewards (GRPO and its variants).
//!
//! A new objective is a new file here with an `impl Objective`, chosen in [`build`].

pub(crate) mod next_token;
pub(crate) mod preference;
pub(crate) mod rl;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, ElementConversion, Tensor};
use ember_data::{Examples, Window};
use ember_kernels::TrainBackend;
use ember_model::Decoder;

use crate::collective::Collective;
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::eval::{eval_seed, Part};
use crate::metrics::StepRecord;

/// The rows an objective trains on and evaluates.
#[derive(Clone, Copy)]
pub(crate) struct Splits<'a> {
    pub(crate) train: &'a Examples,
    pub(crate) val: &'a Examples,
}

/// The split an evaluation scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Split {
    Train,
    Val,
}

impl Split {
    /// The split's name in messages: `evaluation (train)`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }
}

/// An evaluation's sums over all ranks, read: its loss, the metrics a record names beside it and a
/// note for the log line.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Evaluated {
    pub(crate) loss: f64,
    pub(crate) named: Vec<(String, f64)>,
    /// Appended to the evaluation's log line (`, held-out reward accuracy 0.750`), or empty.
    pub(crate) note: String,
}

/// A step's micro-batches over all ranks, in stream order, as rows of the training data: this rank
/// computes every `world`-th from its `rank`, on `device`, its gradients times `loss_scale`.
pub(crate) struct MicroBatches<'a, B: TrainBackend> {
    pub(crate) data: &'a Examples,
    /// The training rows of each micro-batch.
    pub(crate) indices: Vec<Vec<usize>>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) device: &'a Device<B>,
    /// f16's loss scale (1 otherwise).
    pub(crate) loss_scale: f64,
    /// The step, from 1.
    pub(crate) step: usize,
    /// The ranks, for sums an objective needs before its backward passes.
    pub(crate) collective: &'a dyn Collective,
}

impl<B: TrainBackend> MicroBatches<'_, B> {
    /// The rows at `idx`.
    pub(crate) fn rows(&self, idx: &[usize]) -> Vec<Window> {
        idx.iter().map(|&i| self.data.get(i).expect("index drawn below len")).collect()
    }

    /// This rank's share of `all` (one item per micro-batch).
    pub(crate) fn mine<T>(&self, all: Vec<T>) -> Vec<T> {
        all.into_iter().skip(self.rank).step_by(self.world).collect()
    }
}

/// What a step optimizes and how it is measured. The sums of a step and of an evaluation are
/// vectors the ranks add element by element; the objective alone knows what they hold.
pub(crate) trait Objective<B: TrainBackend> {
    /// Forward and backward over this rank's micro-batches of a step: its gradients (times the
    /// loss scale), and its sums, `[loss, …]` (this rank's part of the step's loss first).
    fn forward_backward(
        &self,
        model: &Decoder<B>,
        batches: MicroBatches<'_, B>,
    ) -> Result<(GradientsParams, Vec<f64>), TrainError>;

    /// What a step record holds beside the loss, from the step's sums over all ranks (the loss
    /// left out: `sums[0]` is the first sum after it).
    fn record_step(&self, sums: &[f64], record: &mut StepRecord);

    /// After a step that updated the model: what the objective changes besides the optimizer, from
    /// the step's sums over all ranks (the loss left out). The model as it is by default.
    fn after_step(&self, model: Decoder<B>, _sums: &[f64]) -> Decoder<B> {
        model
    }

    /// This rank's sums of the evaluation of `split` (its batches where `part` keeps them).
    fn evaluate(&self, model: &Decoder<B::InnerBackend>, split: Split, part: Part) -> Result<Vec<f64>, TrainError>;

    /// The evaluation of `split` from its sums over all ranks.
    fn evaluated(&self, sums: &[f64], split: Split) -> Evaluated;
}

/// What the evaluations of either objective read of the config: the fixed batches of each split.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EvalBatches {
    /// Fine-tuning examples (JSONL data): every held-out example is scored instead of `iters`
    /// fixed batches.
    pub(crate) held_out: bool,
    /// `train.batch_size`: rows per evaluation batch.
    pub(crate) batch_size: usize,
    /// `train.eval_iters`: batches per split.
    pub(crate) iters: usize,
    /// The sampler seeds of the fixed batches, from `train.seed`.
    pub(crate) train_seed: u64,
    pub(crate) val_seed: u64,
}

impl EvalBatches {
    pub(crate) fn of(config: &TrainConfig) -> Self {
        let t = &config.train;
        Self {
            held_out: config.data.format() == crate::config::DataFormat::Jsonl,
            batch_size: t.batch_size,
            iters: t.eval_iters,
            train_seed: eval_seed(t.seed, "train"),
            val_seed: eval_seed(t.seed, "val"),
        }
    }
}

/// The objective of `config` over `splits`. Preference tuning against a reference (DPO, IPO)
/// scores the pairs with the model the run starts from, `starting` (called before the run's model
/// is built: the reference model is held only while it does); reinforcement learning reads `rl`
/// (its prompts) and keeps the starting model as the KL term's reference where β > 0.
pub(crate) fn build<'a, B: TrainBackend>(
    config: &TrainConfig,
    splits: Splits<'a>,
    rl: Option<RlData<'a>>,
    starting: impl FnOnce() -> Result<Decoder<B::InnerBackend>, TrainError>,
    c: &dyn Collective,
) -> Result<Box<dyn Objective<B> + 'a>, TrainError> {
    if let Some(r) = &config.rl {
        let Some(data) = rl else {
            return Err(TrainError::Rl("the run's data holds no prompts".into()));
        };
        let reference = if r.beta != 0.0 { Some(starting()?) } else { None };
        let inputs =
            rl::RlInputs { prompts: data.prompts, tokenizer: data.tokenizer, rollouts: data.rollouts, reference };
        return Ok(Box::new(rl::Rl::new(config, r.clone(), inputs)?));
    }
    let reference = match &config.preference {
        Some(p) if p.method.needs_reference() => Some(preference::reference::<B>(config, splits, starting()?, c)?),
        _ => None,
    };
    Ok(build_with(config, splits, reference))
}

/// What reinforcement learning reads of the run: its prompts, the tokenizer, and the file rank 0
/// appends the rollouts to.
pub(crate) struct RlData<'a> {
    pub(crate) prompts: &'a crate::rl::Prompts,
    pub(crate) tokenizer: &'a ember_data::Tokenizer,
    pub(crate) rollouts: Option<std::path::PathBuf>,
}

/// [`build`] for a benchmark, which times the step: without a reference (its values would not
/// change the work). Reinforcement learning's steps are timed by its run's log instead.
pub(crate) fn build_timed<'a, B: TrainBackend>(
    config: &TrainConfig,
    splits: Splits<'a>,
) -> Result<Box<dyn Objective<B> + 'a>, TrainError> {
    if config.rl.is_some() {
        return Err(TrainError::Rl(
            "ember bench train times next-token and preference steps; an [rl] run logs its own step times".into(),
        ));
    }
    Ok(build_with(config, splits, None))
}

fn build_with<'a, B: TrainBackend>(
    config: &TrainConfig,
    splits: Splits<'a>,
    reference: Option<crate::preference::Reference>,
) -> Box<dyn Objective<B> + 'a> {
    match &config.preference {
        Some(p) => Box::new(preference::Pairs::new(config, splits, p.clone(), reference)),
        None => Box::new(next_token::NextToken::new(config, splits)),
    }
}

/// The gradients of a step's micro-batches, accumulated, and the losses they report, kept on the
/// device until every backward pass is queued: one read per step, not a wait between each forward
/// and its backward (which would drain a GPU's queue).
pub(crate) struct Accumulation<B: TrainBackend> {
    grads: GradientsAccumulator<Decoder<B>>,
    reported: Option<Tensor<B::InnerBackend, 1>>,
    loss_scale: f64,
}

impl<B: TrainBackend> Accumulation<B> {
    pub(crate) fn new(loss_scale: f64) -> Self {
        Self { grads: GradientsAccumulator::new(), reported: None, loss_scale }
    }

    /// Adds `value` (without gradients) to the reported loss.
    pub(crate) fn report(&mut self, value: Tensor<B, 1>) {
        let value = value.inner();
        self.reported = Some(match self.reported.take() {
            Some(sum) => sum + value,
            None => value,
        });
    }

    /// Backpropagates `loss` times the loss scale and accumulates its gradients.
    pub(crate) fn backward(&mut self, model: &Decoder<B>, loss: Tensor<B, 1>) {
        let loss = if self.loss_scale == 1.0 { loss } else { loss.mul_scalar(self.loss_scale) };
        self.grads.accumulate(model, GradientsParams::from_grads(loss.backward(), model));
    }

    /// The reported loss, read once, and the accumulated gradients.
    pub(crate) fn finish(mut self) -> (f64, GradientsParams) {
        let loss = self.reported.map_or(0.0, |sum| sum.into_scalar().elem::<f64>());
        (loss, self.grads.grads())
    }
}
