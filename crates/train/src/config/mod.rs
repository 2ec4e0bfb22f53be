//! The training config file: one TOML with `[model]`, `[data]`, `[train]`, `[optim]` and
//! `[schedule]`. Unknown keys are errors, named with their section; a value that breaks a rule is
//! an [`InvalidConfig`] naming the key, the value and the rule. Parsing reads the file alone: a
//! `[model]` left out for `init_from`'s is filled in when the source is opened
//! ([`ConfigFile::resolve`], in `init`).
//!
//! [`sections`]: the schema, one struct per section; [`file`]: reading a file (syntax, unknown
//! keys) and `init_from`; [`defaults`]: the defaults that follow other keys; [`validate`]: the
//! rules, within and across sections, and the bounds that keep products of sizes far from
//! overflow; [`effect`]: the keys that do something only in some configs, refused where they do
//! nothing; [`values`]: values of the wrong type or outside their choices, at any depth, placed by
//! [`toml_path`].

mod defaults;
mod effect;
mod file;
mod keys;
mod sections;
mod toml_path;
mod validate;
mod values;

use ember_model::{LoraConfig, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::error::InvalidConfig;

pub use defaults::Applied;
pub use file::{ConfigFile, InitSource, Purpose};
#[cfg(test)]
pub(crate) use keys::REQUIRED;
pub use keys::{serde_names, ConfigProblem, Hint, Problem};
pub use sections::{
    AdjustLr, DataConfig, DataFormat, DistributedConfig, EvalStrategy, EvalTasksConfig, Importance, LoopConfig,
    MetricsConfig, MuonConfig, NsDtype, OptimConfig, Precision, PreferenceConfig, PreferenceMethod, RewardConfig,
    RewardKind, RlConfig, RlLoss, RlMethod, ScaleRewards, ScheduleConfig, ScheduleShape, SinkKind,
};

/// A run's config: pure data, read from TOML. `M` is the architecture: a [`ModelConfig`], or in a
/// [`ConfigFile`] an `Option` of one (`[model]` may be left out when `init_from` is set).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig<M = ModelConfig> {
    /// Start from pretrained weights: `hf:DIR` (a Hugging Face folder), `gguf:FILE` (a GGUF model,
    /// kept quantized under LoRA) or `run:DIR` (an ember run
    /// or checkpoint). `[model]` may then be left out: it comes from the source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<InitSource>,
    pub model: M,
    pub data: DataConfig,
    pub train: LoopConfig,
    pub optim: OptimConfig,
    pub schedule: ScheduleConfig,
    /// Fine-tune low-rank adapters instead of every weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// Muon for the hidden matrices (AdamW for the rest); absent: AdamW for every parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub muon: Option<MuonConfig>,
    /// Preference tuning (DPO, IPO, SimPO, ORPO) on pairs of answers instead of the next-token loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preference: Option<PreferenceConfig>,
    /// Reinforcement learning (GRPO) on prompts and rewards instead of the next-token loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rl: Option<RlConfig>,
    /// Benchmark tasks scored at every evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalTasksConfig>,
    /// Where metrics go, and the text sampled at evaluations.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// How the ranks of a data-parallel run (`mpirun -n N ember train`) cooperate.
    #[serde(default, skip_serializing_if = "is_default_distributed")]
    pub distributed: DistributedConfig,
    /// A length given in epochs (`train.num_epochs`) before the data is loaded: the step count and
    /// the defaults that follow it wait for the row count ([`TrainConfig::resolve_epochs`]).
    #[serde(skip)]
    pub pending: Option<PendingLength>,
}

/// What a config that gives its length in epochs still lacks: `max_steps`, and the defaults
/// derived from it that the file left out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PendingLength {
    pub num_epochs: f64,
    /// `train.eval_interval` was left out: `max_steps / 10`.
    pub eval_interval: bool,
    /// `schedule.warmup_steps` was left out (and `decay_steps` too): `max_steps / 20`.
    pub warmup_steps: bool,
}

fn is_default_distributed(d: &DistributedConfig) -> bool {
    *d == DistributedConfig::default()
}

/// The longest `train.seq_len` a run from `init_from` gets when it leaves the key out: the
/// pretrained context (8,192 positions for SmolLM2) is far past what most fine-tunes need, and the
/// activations grow with it.
pub(crate) const SEQ_LEN_CAP: usize = 2048;
/// A default `train.seq_len` from the examples is a multiple of this.
const SEQ_LEN_STEP: usize = 64;

impl TrainConfig {
    /// Tokens per sequence: `train.seq_len`. A run fills it in when it loads the data
    /// ([`TrainConfig::default_seq_len`]); before that, a config that leaves it out gets the model's
    /// context.
    pub fn seq_len(&self) -> usize {
        self.train.seq_len.unwrap_or(self.model.max_seq_len)
    }

    /// The `train.seq_len` of a config that leaves it out. JSONL examples (the longest has
    /// `longest` tokens): the longest rounded up to a multiple of 64, so that every example fits a
    /// row; a text stream: the model's context. Never past the context, nor, for a model from
    /// `init_from` (whose context the config did not choose), past [`SEQ_LEN_CAP`].
    pub(crate) fn default_seq_len(&self, longest: Option<usize>) -> usize {
        // A row of `seq_len` positions holds an example of `seq_len + 1` tokens (inputs and targets).
        let wanted = longest.map_or(usize::MAX, |n| n.saturating_sub(1).max(1).div_ceil(SEQ_LEN_STEP) * SEQ_LEN_STEP);
        let cap = if self.init_from.is_some() { SEQ_LEN_CAP } else { usize::MAX };
        wanted.min(cap).min(self.model.max_seq_len)
    }

    /// Model FLOPs per token of a training step, for MFU: `6N + 12·L·T·d`, or with LoRA (a frozen
    /// base: no weight gradients but the adapters') `4N + 6·L·Σ r·(in + out) + 12·L·T·d`.
    pub(crate) fn train_flops_per_token(&self) -> f64 {
        match &self.lora {
            Some(lora) => lora.train_flops_per_token(&self.model, self.seq_len()),
            None => self.model.train_flops_per_token(self.seq_len()),
        }
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.train.batch_size * self.seq_len() * self.train.grad_accum_steps
    }
}

impl<M> TrainConfig<M> {
    /// The same config with the architecture `model`.
    pub(crate) fn with_model<N>(self, model: N) -> TrainConfig<N> {
        TrainConfig {
            init_from: self.init_from,
            model,
            data: self.data,
            train: self.train,
            optim: self.optim,
            schedule: self.schedule,
            lora: self.lora,
            muon: self.muon,
            preference: self.preference,
            rl: self.rl,
            eval: self.eval,
            metrics: self.metrics,
            distributed: self.distributed,
            pending: self.pending,
        }
    }

    /// Turns a length in epochs into steps, now that the training split's `rows` are known and
    /// `ranks` share each step: `max_steps = ceil(num_epochs × rows / rows per step)`, with the
    /// evaluation cadence and warmup that follow it where the file left them out. The config then
    /// reads as if it had said `max_steps` (what the run directory keeps); the rules that need the
    /// length are checked. Nothing to do for a config that gave `max_steps`.
    pub(crate) fn resolve_epochs(&mut self, rows: usize, ranks: usize) -> Result<(), InvalidConfig> {
        let Some(p) = self.pending.take() else { return Ok(()) };
        let per_step = self.train.batch_size.saturating_mul(self.train.grad_accum_steps).saturating_mul(ranks).max(1);
        let steps = (p.num_epochs * rows as f64 / per_step as f64).ceil().max(1.0);
        // Saturating: a count past the bound is reported by the rules below.
        self.train.max_steps = if steps < (1u64 << 52) as f64 { steps as usize } else { usize::MAX };
        self.train.num_epochs = None;
        let steps = self.train.max_steps as u64;
        // With evaluations at each epoch the interval is not used (and stays 0).
        if p.eval_interval && self.train.eval_strategy == EvalStrategy::Steps {
            self.train.eval_interval = usize::try_from(defaults::eval_interval(steps)).unwrap_or(usize::MAX);
        }
        if p.warmup_steps {
            self.schedule.warmup_steps = usize::try_from(defaults::warmup_steps(steps)).unwrap_or(usize::MAX);
        }
        tracing::info!(
            "train.num_epochs = {}: {rows} rows, {per_step} a step (batch_size {} × grad_accum_steps {} × {ranks} \
             rank(s)) -> max_steps = {}, eval_interval = {}, warmup_steps = {}",
            p.num_epochs,
            self.train.batch_size,
            self.train.grad_accum_steps,
            self.train.max_steps,
            self.train.eval_interval,
            self.schedule.warmup_steps
        );
        // The config's other rules held when it was parsed (for its purpose: a benchmark's may put
        // adapters on a random base); these are the ones the length changes.
        self.validate_sections_for(Purpose::Bench)
    }

    pub fn decay_steps(&self) -> usize {
        self.schedule.decay_steps.unwrap_or(self.train.max_steps)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::error::TrainError;
    use std::path::Path;

    pub(crate) const NANO: &str = include_str!("../../../../configs/nano.toml");

    pub(crate) fn parse(text: &str) -> Result<TrainConfig, TrainError> {
        TrainConfig::from_toml(text, Path::new("c.toml"))
    }

    /// The message of the error `text` is refused with.
    pub(crate) fn parse_err(text: &str) -> String {
        parse(text).expect_err("the config is refused").to_string()
    }

    #[test]
    fn nano_config_is_nanogpts_cpu_setting() {
        let c = parse(NANO).unwrap();
        assert_eq!((c.model.n_layers, c.model.n_heads, c.model.d_model), (4, 4, 128));
        assert_eq!((c.seq_len(), c.train.batch_size, c.train.max_steps), (64, 12, 2000));
        assert_eq!((c.schedule.lr, c.schedule.min_lr, c.schedule.warmup_steps), (1e-3, 1e-4, 100));
        assert_eq!((c.optim.beta1, c.optim.beta2, c.optim.weight_decay, c.optim.grad_clip), (0.9, 0.99, 0.1, 1.0));
        // Round trip through the resolved form saved in run directories.
        assert_eq!(parse(&c.to_toml()).unwrap(), c);
    }
}
