//! The defaults that depend on other keys (the learning rate on what is trained and how, the
//! evaluation cadence and the warmup on the run's length, LoRA's alpha on its rank), and those a
//! fine-tune should not have to say (the batch, LoRA's targets), written into the parsed file
//! before serde reads it, so that the config a run directory keeps says what ran; each one put in
//! is logged as a default when the run starts ([`Applied`]). Defaults that stand alone are
//! serde's, on the section structs ([`super::sections`]).

use ember_model::lora::Target;

/// LoRA: the rate of the LoRA and QLoRA papers' recipes (and PEFT's examples) for adapters.
pub(crate) const LR_LORA: f64 = 2e-4;
/// Every weight of a pretrained model: Hugging Face Trainer's default `learning_rate`.
pub(crate) const LR_FULL: f64 = 5e-5;
/// From scratch: nanoGPT's `train.py` default (GPT-3 Small's rate).
pub(crate) const LR_SCRATCH: f64 = 6e-4;
/// Preference tuning with LoRA: half of SFT's: at 2e-4 plain DPO overshot into answers with no
/// content, 1e-4 with the NLL term kept both style and facts (experiments/dpo.md).
pub(crate) const LR_PREFERENCE_LORA: f64 = 1e-4;
/// Reinforcement learning with LoRA: 1e-4 collapsed the answers' entropy within 30 steps, 5e-5
/// trained (experiments/grpo.md).
pub(crate) const LR_RL_LORA: f64 = 5e-5;
/// Preference tuning or reinforcement learning of every weight: TRL's `DPOConfig` and
/// `GRPOConfig` default `learning_rate` (1e-6): the policy moves far per step with every weight.
pub(crate) const LR_RL_FULL: f64 = 1e-6;
/// `train.batch_size` left out: Hugging Face Trainer's (and so TRL's) `per_device_train_batch_size`.
/// Eight rows keep a step's gradient from resting on one or two examples while a small model's
/// step stays within a laptop's memory; the memory estimate at start refuses a run that would not
/// fit and says to lower it.
pub(crate) const BATCH_SIZE: u64 = 8;
/// `lora.alpha` left out: this times the rank. PEFT's `lora_alpha` is 8 whatever the rank, so its
/// update's scale `alpha / rank` halves each time the rank doubles; twice the rank keeps the scale
/// at 2 for every rank, the pair (rank 8, alpha 16) of the QLoRA recipes and of ember's templates.
pub(crate) const ALPHA_PER_RANK: u64 = 2;
/// Evaluations in a run whose `eval_interval` is left out (and the first and last).
pub(crate) const EVALS_PER_RUN: u64 = 10;
/// Warmup, as a fraction of the decay steps, where `warmup_steps` is left out (1 in 20 steps:
/// within the 3–10 % fine-tuning recipes use).
pub(crate) const WARMUP_DIVISOR: u64 = 20;

/// What a run trains toward: the next token (SFT or pretraining), preferences, or rewards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Objective {
    NextToken,
    Preference,
    Rl,
}

/// The learning rate of a config that leaves `schedule.lr` out.
pub(crate) fn lr(lora: bool, init_from: bool, objective: Objective) -> f64 {
    match (lora, init_from, objective) {
        (true, _, Objective::NextToken) => LR_LORA,
        (true, _, Objective::Preference) => LR_PREFERENCE_LORA,
        (true, _, Objective::Rl) => LR_RL_LORA,
        (false, true, Objective::NextToken) => LR_FULL,
        (false, true, Objective::Preference | Objective::Rl) => LR_RL_FULL,
        (false, false, _) => LR_SCRATCH,
    }
}

/// A default [`fill`] put in, for the log: `[train] batch_size = 8 (default: …)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    pub section: &'static str,
    pub key: &'static str,
    /// The value, as TOML writes it.
    pub value: String,
    /// Where it comes from.
    pub why: &'static str,
}

impl std::fmt::Display for Applied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}] {} = {} (default: {})", self.section, self.key, self.value, self.why)
    }
}

/// The seven projections of a Llama-style block, LoRA's targets when `lora.targets` is left out
/// (those of ember's templates; a model whose MLP has no gate loses `gate_proj` once it is known).
pub(crate) const TARGETS: [Target; 7] = Target::ALL;

/// Fills in `table` (a config file, its keys checked) the defaults that depend on other keys,
/// where they are left out: `[optim]` and `[schedule]` whole, `schedule.lr`,
/// `schedule.warmup_steps`, `train.eval_interval` (with `eval_strategy = "steps"`),
/// `train.batch_size`, `lora.alpha` and `lora.targets`; returns those put in. A key whose inputs
/// are missing or mistyped is left out (those are reported); so are those that follow a length
/// given in epochs (`train.num_epochs`), until the data is loaded
/// ([`super::TrainConfig::resolve_epochs`]).
pub(crate) fn fill(table: &mut toml::Table) -> Vec<Applied> {
    let mut applied = Vec::new();
    let mut put = |section: &mut toml::Table, name: &'static str, key: &'static str, value, why| {
        if !section.contains_key(key) {
            applied.push(Applied { section: name, key, value: toml_text(&value), why });
            section.insert(key.into(), value);
        }
    };
    let (lora, init_from) = (table.contains_key("lora"), table.contains_key("init_from"));
    let objective = match (table.contains_key("preference"), table.contains_key("rl")) {
        (_, true) => Objective::Rl,
        (true, false) => Objective::Preference,
        (false, false) => Objective::NextToken,
    };
    for section in ["optim", "schedule"] {
        table.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let max_steps = table
        .get("train")
        .and_then(|t| t.get("max_steps"))
        .and_then(toml::Value::as_integer)
        .and_then(|n| u64::try_from(n).ok());
    if let Some(train) = table.get_mut("train").and_then(toml::Value::as_table_mut) {
        put(train, "train", "batch_size", integer(BATCH_SIZE), "Hugging Face Trainer's and TRL's per-device batch");
        // With evaluations at each epoch the interval is not used.
        let by_steps = train.get("eval_strategy").and_then(toml::Value::as_str) != Some("epoch");
        if let (Some(max_steps), true) = (max_steps, by_steps) {
            put(train, "train", "eval_interval", integer(eval_interval(max_steps)), "max_steps / 10");
        }
    }
    if let Some(adapters) = table.get_mut("lora").and_then(toml::Value::as_table_mut) {
        let rank = adapters.get("rank").and_then(toml::Value::as_integer).and_then(|n| u64::try_from(n).ok());
        if let Some(rank) = rank {
            let alpha = toml::Value::Float(rank.saturating_mul(ALPHA_PER_RANK) as f64);
            put(adapters, "lora", "alpha", alpha, "2 × rank, an update scaled by 2");
        }
        let targets = TARGETS.iter().map(|t| toml::Value::String(t.to_string())).collect();
        put(adapters, "lora", "targets", toml::Value::Array(targets), "every projection of the blocks");
    }
    let Some(schedule) = table.get_mut("schedule").and_then(toml::Value::as_table_mut) else { return applied };
    let why = match (lora, init_from, objective) {
        (false, false, _) => "from scratch",
        (true, _, Objective::NextToken) => "LoRA",
        (true, _, Objective::Preference) => "LoRA, preference tuning",
        (true, _, Objective::Rl) => "LoRA, reinforcement learning",
        (false, true, Objective::NextToken) => "every weight of a pretrained model",
        (false, true, Objective::Preference) => "every weight, preference tuning",
        (false, true, Objective::Rl) => "every weight, reinforcement learning",
    };
    put(schedule, "schedule", "lr", toml::Value::Float(lr(lora, init_from, objective)), why);
    let decay_steps = match schedule.get("decay_steps") {
        Some(v) => v.as_integer().and_then(|n| u64::try_from(n).ok()),
        None => max_steps,
    };
    if let Some(decay_steps) = decay_steps {
        put(schedule, "schedule", "warmup_steps", integer(warmup_steps(decay_steps)), "decay_steps / 20");
    }
    applied
}

/// A value as a TOML file writes it (`2e-4` as `0.0002`).
fn toml_text(value: &toml::Value) -> String {
    value.to_string()
}

/// `train.eval_interval` of a run of `max_steps` that leaves it out.
pub(crate) fn eval_interval(max_steps: u64) -> u64 {
    (max_steps / EVALS_PER_RUN).max(1)
}

/// `schedule.warmup_steps` of a run whose learning rate decays over `decay_steps`, where left out.
pub(crate) fn warmup_steps(decay_steps: u64) -> u64 {
    decay_steps / WARMUP_DIVISOR
}

fn integer(n: u64) -> toml::Value {
    toml::Value::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}
