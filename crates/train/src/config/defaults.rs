//! The defaults that depend on other keys (the learning rate on what is trained, the evaluation
//! cadence and the warmup on the run's length), written into the parsed file before serde reads
//! it, so that the config a run directory keeps says what ran. Defaults that stand alone are
//! serde's, on the section structs ([`super::sections`]).

/// LoRA: the rate of the LoRA and QLoRA papers' recipes (and PEFT's examples) for adapters.
pub const LR_LORA: f64 = 2e-4;
/// Every weight of a pretrained model: Hugging Face Trainer's default `learning_rate`.
pub const LR_FULL: f64 = 5e-5;
/// From scratch: nanoGPT's `train.py` default (GPT-3 Small's rate).
pub const LR_SCRATCH: f64 = 6e-4;
/// Evaluations in a run whose `eval_interval` is left out (and the first and last).
pub(crate) const EVALS_PER_RUN: u64 = 10;
/// Warmup, as a fraction of the decay steps, where `warmup_steps` is left out (1 in 20 steps:
/// within the 3–10 % fine-tuning recipes use).
pub(crate) const WARMUP_DIVISOR: u64 = 20;

/// The learning rate of a config that leaves `schedule.lr` out.
pub fn lr(lora: bool, init_from: bool) -> f64 {
    match (lora, init_from) {
        (true, _) => LR_LORA,
        (false, true) => LR_FULL,
        (false, false) => LR_SCRATCH,
    }
}

/// Fills in `table` (a config file, its keys checked) the defaults that depend on other keys,
/// where they are left out: `[optim]` and `[schedule]` whole, `schedule.lr`,
/// `schedule.warmup_steps` and `train.eval_interval`. A key whose inputs are missing or mistyped
/// is left out (those are reported); so are those that follow a length given in epochs
/// (`train.num_epochs`), until the data is loaded ([`super::TrainConfig::resolve_epochs`]).
pub fn fill(table: &mut toml::Table) {
    let (lora, init_from) = (table.contains_key("lora"), table.contains_key("init_from"));
    for section in ["optim", "schedule"] {
        table.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let max_steps = table
        .get("train")
        .and_then(|t| t.get("max_steps"))
        .and_then(toml::Value::as_integer)
        .and_then(|n| u64::try_from(n).ok());
    if let (Some(max_steps), Some(train)) = (max_steps, table.get_mut("train").and_then(toml::Value::as_table_mut)) {
        train.entry("eval_interval").or_insert_with(|| integer(eval_interval(max_steps)));
    }
    let Some(schedule) = table.get_mut("schedule").and_then(toml::Value::as_table_mut) else { return };
    schedule.entry("lr").or_insert(toml::Value::Float(lr(lora, init_from)));
    let decay_steps = match schedule.get("decay_steps") {
        Some(v) => v.as_integer().and_then(|n| u64::try_from(n).ok()),
        None => max_steps,
    };
    if let Some(decay_steps) = decay_steps {
        schedule.entry("warmup_steps").or_insert_with(|| integer(warmup_steps(decay_steps)));
    }
}

/// `train.eval_interval` of a run of `max_steps` that leaves it out.
pub fn eval_interval(max_steps: u64) -> u64 {
    (max_steps / EVALS_PER_RUN).max(1)
}

/// `schedule.warmup_steps` of a run whose learning rate decays over `decay_steps`, where left out.
pub fn warmup_steps(decay_steps: u64) -> u64 {
    decay_steps / WARMUP_DIVISOR
}

fn integer(n: u64) -> toml::Value {
    toml::Value::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}
