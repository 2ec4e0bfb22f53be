//! The rules of a config: each section's own, then those across sections; a value that breaks one
//! is an [`InvalidConfig`] naming the key, the value and the rule. The bounds on sizes keep every
//! product of them (tokens per step, memory estimates) far from overflow.

use ember_model::ModelConfig;

use super::file::Purpose;
use super::sections::{DataConfig, DataFormat, DistributedConfig, EvalStrategy, LoopConfig, MetricsConfig};
use super::sections::{MuonConfig, OptimConfig, PreferenceConfig, RlConfig, ScheduleConfig};
use super::values::float;
use super::TrainConfig;
use crate::error::{InvalidConfig, Relation};

impl TrainConfig {
    /// Every rule, within and across sections. The model's own rules run once the vocabulary is
    /// known (a vocabulary of 0 comes from the tokenizer).
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        self.validate_sections()?;
        self.validate_model()
    }

    /// The rules that need the model: its own, and the sequence length within its context.
    pub(super) fn validate_model(&self) -> Result<(), InvalidConfig> {
        if self.seq_len() == 0 || self.seq_len() > self.model.max_seq_len {
            return Err(InvalidConfig::Bounded {
                key: "train.seq_len",
                value: self.seq_len().to_string(),
                relation: Relation::OneTo,
                bound_key: "model.max_seq_len",
                bound: self.model.max_seq_len.to_string(),
            });
        }
        if self.model.vocab_size != 0 {
            self.model.validate()?;
        } else {
            // Everything but the vocabulary can be checked now.
            ModelConfig { vocab_size: 1, ..self.model.clone() }.validate()?;
        }
        if let Some(lora) = &self.lora {
            lora.validate_for(&self.model).map_err(InvalidConfig::Lora)?;
        }
        Ok(())
    }
}

impl<M> TrainConfig<M> {
    /// The rules of every section but `[model]`, then those across sections.
    pub(crate) fn validate_sections(&self) -> Result<(), InvalidConfig> {
        self.validate_sections_for(Purpose::Run)
    }

    /// [`Self::validate_sections`] for `purpose`: the first rule broken.
    pub(crate) fn validate_sections_for(&self, purpose: Purpose) -> Result<(), InvalidConfig> {
        self.broken_rules(purpose).into_iter().next().map_or(Ok(()), Err)
    }

    /// Every rule of [`Self::validate_sections_for`] the config breaks, in the order of the
    /// sections.
    pub(crate) fn broken_rules(&self, purpose: Purpose) -> Vec<InvalidConfig> {
        let mut broken = Vec::new();
        if let Some(lora) = &self.lora {
            if let Err(e) = lora.validate() {
                broken.push(InvalidConfig::Lora(e));
            }
            if self.init_from.is_none() && purpose == Purpose::Run {
                broken.push(InvalidConfig::LoraWithoutInit);
            }
        }
        self.data.check(&mut broken);
        if let (Some(target), Some(0.0)) = (self.train.target_val_loss, self.data.val_fraction) {
            let needs = "validation: data.val_fraction above 0 or data.val_path";
            broken.push(InvalidConfig::Needs { key: "train.target_val_loss", value: float(target), needs });
        }
        if self.data.format() == DataFormat::Text && self.train.eval_strategy == EvalStrategy::Epoch {
            broken.push(InvalidConfig::JsonlOnly { key: "train.eval_strategy", value: "\"epoch\"".into() });
        }
        if self.data.format() == DataFormat::Text {
            if let Some(n) = self.train.num_epochs {
                broken.push(InvalidConfig::JsonlOnly { key: "train.num_epochs", value: float(n) });
            }
        }
        self.train.check(&mut broken, self.pending.is_some());
        self.optim.check(&mut broken);
        if let Some(muon) = &self.muon {
            muon.check(&mut broken);
        }
        if let Some(p) = &self.preference {
            p.check(&mut broken);
            if self.data.format() == DataFormat::Text {
                broken.push(InvalidConfig::JsonlOnly { key: "preference.method", value: format!("\"{}\"", p.method) });
            }
        }
        if let Some(rl) = &self.rl {
            rl.check(&mut broken);
            if self.data.format() == DataFormat::Text {
                broken.push(InvalidConfig::JsonlOnly { key: "rl.method", value: "\"grpo\"".into() });
            }
            if self.preference.is_some() {
                broken.push(InvalidConfig::Rl("[rl] and [preference] are two objectives: keep one".into()));
            }
        }
        self.schedule.check(&mut broken);
        // A length in epochs is checked once the data gives it (`resolve_epochs`).
        let length_known = self.pending.is_none() || self.schedule.decay_steps.is_some();
        if length_known && self.schedule.warmup_steps > self.decay_steps() {
            broken.push(InvalidConfig::Bounded {
                key: "schedule.warmup_steps",
                value: self.schedule.warmup_steps.to_string(),
                relation: Relation::NotAbove,
                // `decay_steps` is `train.max_steps` when absent.
                bound_key: if self.schedule.decay_steps.is_some() { "schedule.decay_steps" } else { "train.max_steps" },
                bound: self.decay_steps().to_string(),
            });
        }
        if let Some(eval) = &self.eval {
            if eval.tasks.is_empty() {
                broken
                    .push(InvalidConfig::EvalTasks("an empty list; name at least one task (\"hellaswag:500\")".into()));
            } else if let Err(e) = ember_eval::tasks::select(&eval.tasks.join(",")) {
                broken.push(InvalidConfig::EvalTasks(e.to_string()));
            }
        }
        self.metrics.check(&mut broken);
        if let Err(e) = self.distributed.validate() {
            broken.push(e);
        }
        broken
    }
}

impl MetricsConfig {
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        if self.sinks.is_empty() {
            broken.push(InvalidConfig::NoSinks);
        }
        // Far above any sensible sample; keeps the generation's buffers far from overflow.
        broken.extend(at_most("metrics.sample_tokens", self.sample_tokens, 1 << 20).err());
    }
}

impl DataConfig {
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        if self.format() == DataFormat::Jsonl && self.path.is_none() {
            broken.push(InvalidConfig::Needs { key: "data.format", value: "\"jsonl\"".into(), needs: "data.path" });
        }
        match (&self.dataset, &self.path) {
            (None, None) => broken.push(InvalidConfig::NoData),
            (Some(dataset), Some(path)) => {
                broken.push(InvalidConfig::TwoData { dataset: dataset.clone(), path: path.display().to_string() })
            }
            _ => {}
        }
        if self.format() == DataFormat::Text {
            if let Some(p) = self.packing {
                broken.push(InvalidConfig::JsonlOnly { key: "data.packing", value: format!("\"{p}\"") });
            }
            if self.truncate {
                broken.push(InvalidConfig::JsonlOnly { key: "data.truncate", value: "true".into() });
            }
        }
        if let Some(f) = self.val_fraction.filter(|f| !(*f >= 0.0 && *f < 1.0)) {
            broken.push(out_of_range("data.val_fraction", f, "in [0, 1) (0: no validation)"));
        }
        if let (Some(f), Some(_)) = (self.val_fraction, &self.val_path) {
            let rule = "left out where data.val_path is set (the validation file replaces it)";
            broken.push(out_of_range("data.val_fraction", f, rule));
        }
    }
}

impl LoopConfig {
    /// `pending`: the length is given in epochs and not yet in steps (`max_steps`, and perhaps
    /// `eval_interval`, are filled in once the data is loaded).
    fn check(&self, broken: &mut Vec<InvalidConfig>, pending: bool) {
        for (key, v) in [
            ("train.batch_size", self.batch_size),
            ("train.grad_accum_steps", self.grad_accum_steps),
            ("train.max_steps", if pending { 1 } else { self.max_steps }),
            // Not used with evaluations at each epoch; filled in from the length in epochs once known.
            (
                "train.eval_interval",
                if (pending || self.eval_strategy == EvalStrategy::Epoch) && self.eval_interval == 0 {
                    1
                } else {
                    self.eval_interval
                },
            ),
            ("train.eval_iters", self.eval_iters),
            ("train.log_interval", self.log_interval),
            ("train.keep_checkpoints", self.keep_checkpoints),
        ] {
            if v == 0 {
                broken.push(out_of_range(key, v, "at least 1"));
            }
        }
        // Bounds that keep every product of sizes (tokens per step, memory estimates, evaluation
        // work) far from overflow, each far above any sensible run.
        for (key, v, limit) in [
            ("train.batch_size", self.batch_size, 1 << 20),
            ("train.grad_accum_steps", self.grad_accum_steps, 1 << 20),
            ("train.max_steps", self.max_steps, 1 << 40),
            ("train.eval_iters", self.eval_iters, 1 << 20),
            ("train.keep_checkpoints", self.keep_checkpoints, 1 << 20),
        ] {
            broken.extend(at_most(key, v, limit).err());
        }
        if let Some(n) = self.num_epochs.filter(|n| !(*n > 0.0 && *n <= 1e6)) {
            broken.push(out_of_range("train.num_epochs", n, "in (0, 1000000]"));
        }
        if let Some(t) = self.target_val_loss.filter(|t| !(*t > 0.0 && t.is_finite())) {
            broken.push(out_of_range("train.target_val_loss", t, "finite, above 0"));
        }
    }
}

impl OptimConfig {
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        for (key, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                broken.push(out_of_range(key, v, "in [0, 1)"));
            }
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            broken.push(out_of_range("optim.eps", self.eps, "positive"));
        }
        for (key, v) in [("optim.weight_decay", self.weight_decay), ("optim.grad_clip", self.grad_clip)] {
            if !(v >= 0.0 && v.is_finite()) {
                broken.push(out_of_range(key, v, ">= 0"));
            }
        }
    }
}

impl MuonConfig {
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            broken.push(out_of_range("muon.lr", self.lr, "positive"));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            broken.push(out_of_range("muon.momentum", self.momentum, "in [0, 1)"));
        }
        if !(1..100).contains(&self.ns_steps) {
            broken.push(out_of_range("muon.ns_steps", self.ns_steps, "in 1..=99"));
        }
        if !self.ns_coefficients.iter().all(|c| c.is_finite()) {
            let shown: Vec<String> = self.ns_coefficients.iter().map(|c| float(*c)).collect();
            broken.push(out_of_range("muon.ns_coefficients", format!("[{}]", shown.join(", ")), "finite"));
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            broken.push(out_of_range("muon.eps", self.eps, "positive"));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            broken.push(out_of_range("muon.weight_decay", self.weight_decay, ">= 0"));
        }
    }
}

impl PreferenceConfig {
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            broken.push(out_of_range("preference.beta", self.beta, "positive"));
        }
        // Written with ipo or orpo, which do not use it, it is refused as a key with no effect
        // (`config::effect`).
        if !(0.0..0.5).contains(&self.label_smoothing) {
            broken.push(out_of_range("preference.label_smoothing", self.label_smoothing, "in [0, 0.5)"));
        }
        if !(self.sft_weight >= 0.0 && self.sft_weight.is_finite()) {
            broken.push(out_of_range("preference.sft_weight", self.sft_weight, ">= 0"));
        }
        if !self.simpo_gamma.is_finite() {
            broken.push(out_of_range("preference.simpo_gamma", self.simpo_gamma, "finite"));
        }
    }
}

impl RlConfig {
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        if self.group_size < 2 {
            broken.push(out_of_range(
                "rl.group_size",
                self.group_size,
                "at least 2 (the advantage compares a prompt's answers)",
            ));
        }
        broken.extend(at_most("rl.group_size", self.group_size, 1024).err());
        if self.max_new_tokens == 0 {
            broken.push(out_of_range("rl.max_new_tokens", 0, "at least 1"));
        }
        broken.extend(at_most("rl.max_new_tokens", self.max_new_tokens, 1 << 20).err());
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            broken.push(out_of_range("rl.temperature", self.temperature, "positive (answers are sampled)"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            broken.push(out_of_range("rl.top_p", self.top_p, "in (0, 1]"));
        }
        if self.top_k == Some(0) {
            broken.push(out_of_range("rl.top_k", 0, "at least 1"));
        }
        if self.stop.iter().any(String::is_empty) {
            broken.push(InvalidConfig::Rl("stop holds an empty text, which would end every answer at once".into()));
        }
        if !(self.epsilon > 0.0 && self.epsilon < 1.0) {
            broken.push(out_of_range("rl.epsilon", self.epsilon, "in (0, 1)"));
        }
        if let Some(e) = self.epsilon_high.filter(|e| !(*e > 0.0 && e.is_finite())) {
            broken.push(out_of_range("rl.epsilon_high", e, "positive"));
        }
        if !(self.beta >= 0.0 && self.beta.is_finite()) {
            broken.push(out_of_range("rl.beta", self.beta, ">= 0"));
        }
        if self.num_iterations == 0 {
            broken.push(out_of_range("rl.num_iterations", 0, "at least 1"));
        }
        broken.extend(at_most("rl.num_iterations", self.num_iterations, 1024).err());
        if self.rewards.is_empty() {
            broken.push(InvalidConfig::Rl("rewards is empty: add at least one [[rl.rewards]] with a kind".into()));
        }
        let mut names = std::collections::HashSet::new();
        for (i, r) in self.rewards.iter().enumerate() {
            let at = format!("rewards[{i}] (kind = \"{}\")", r.kind.as_str());
            let own = r.kind.keys();
            for key in r.set_keys() {
                if !own.iter().any(|(k, _)| *k == key) {
                    let takes: Vec<&str> = own.iter().map(|(k, _)| *k).collect();
                    let takes = if takes.is_empty() { "no other key".to_string() } else { takes.join(", ") };
                    broken.push(InvalidConfig::Rl(format!(
                        "{at}: `{key}` has no effect on this kind (it takes {takes})"
                    )));
                }
            }
            for (key, required) in own {
                if *required && !r.set_keys().contains(key) {
                    broken.push(InvalidConfig::Rl(format!("{at}: `{key}` is missing")));
                }
            }
            if !r.weight.is_finite() {
                broken.push(InvalidConfig::Rl(format!("{at}: weight must be finite, found {}", r.weight)));
            }
            if let Some(p) = &r.pattern {
                if let Err(e) = regex::Regex::new(p) {
                    broken.push(InvalidConfig::Rl(format!("{at}: pattern {p:?} is not a regular expression: {e}")));
                }
            }
            if r.command.as_deref().is_some_and(|c| c.trim().is_empty()) {
                broken.push(InvalidConfig::Rl(format!("{at}: command is empty")));
            }
            if !names.insert(r.name().to_string()) {
                broken.push(InvalidConfig::Rl(format!(
                    "{at}: the name \"{}\" is taken by an earlier reward; set name = \"…\"",
                    r.name()
                )));
            }
        }
    }
}

impl ScheduleConfig {
    /// The rates (the warmup against the decay steps, `train.max_steps` by default, is checked
    /// across sections).
    fn check(&self, broken: &mut Vec<InvalidConfig>) {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            broken.push(out_of_range("schedule.lr", self.lr, "positive"));
        }
        if !(self.cooldown_frac > 0.0 && self.cooldown_frac <= 1.0) {
            broken.push(out_of_range("schedule.cooldown_frac", self.cooldown_frac, "in (0, 1]"));
        }
        if !(self.min_lr >= 0.0 && self.min_lr.is_finite()) {
            broken.push(out_of_range("schedule.min_lr", self.min_lr, ">= 0"));
        } else if self.lr > 0.0 && self.min_lr > self.lr {
            broken.push(InvalidConfig::Bounded {
                key: "schedule.min_lr",
                value: float(self.min_lr),
                relation: Relation::NotAbove,
                bound_key: "schedule.lr",
                bound: float(self.lr),
            });
        }
    }
}

impl DistributedConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        // MPI counts elements in a C int: a bucket stays below 2^31 f32 values.
        if self.bucket_mib == 0 || self.bucket_mib > 4096 {
            return Err(out_of_range("distributed.bucket_mib", self.bucket_mib, "in 1..=4096"));
        }
        for (key, v) in [("distributed.timeout_s", self.timeout_s), ("distributed.io_timeout_s", self.io_timeout_s)] {
            if !(v > 0.0 && v <= 7.0 * 86_400.0) {
                return Err(out_of_range(key, v, "in (0, 604800] seconds"));
            }
        }
        Ok(())
    }
}

fn out_of_range(key: &'static str, value: impl Shown, rule: &'static str) -> InvalidConfig {
    InvalidConfig::OutOfRange { key, value: value.shown(), rule }
}

/// A value as a message prints it: floats in their short form ([`float`]), not 309 digits.
trait Shown {
    fn shown(&self) -> String;
}

impl Shown for f64 {
    fn shown(&self) -> String {
        float(*self)
    }
}

impl Shown for usize {
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for String {
    fn shown(&self) -> String {
        self.clone()
    }
}

fn at_most(key: &'static str, value: usize, limit: u64) -> Result<(), InvalidConfig> {
    match value as u64 {
        v if v > limit => Err(InvalidConfig::TooLarge { key, value: v, limit }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{parse, parse_err, NANO};
    use ember_data::finetune::Packing;

    #[test]
    fn heads_not_divisible_by_kv_heads_is_an_error() {
        let text = NANO.replace("n_kv_heads = 4", "n_kv_heads = 3");
        assert_eq!(parse_err(&text), "c.toml: model.n_kv_heads (3) must divide model.n_heads (4)");
    }

    #[test]
    fn cross_section_rules() {
        let e = parse_err(&NANO.replace("warmup_steps = 100", "warmup_steps = 5000"));
        assert!(e.contains("schedule.warmup_steps (5000)"), "{e}");
        let e = parse_err(&NANO.replace("batch_size = 12", "batch_size = 0"));
        assert!(e.contains("train.batch_size must be at least 1"), "{e}");
        let e = parse_err(&NANO.replace("dataset = \"tinyshakespeare\"", ""));
        assert!(e.contains("data: set `dataset`"), "{e}");
        let e = parse_err(&NANO.replace("lr = 1e-3", "lr = -1.0"));
        assert!(e.contains("schedule.lr must be positive"), "{e}");
        let e = parse_err(&NANO.replace("batch_size = 12", "batch_size = \"twelve\""));
        assert!(e.contains("[train] batch_size: invalid type: string \"twelve\", expected usize"), "{e}");
    }

    #[test]
    fn a_broken_rule_names_the_key_the_value_and_the_rule() {
        let nano = parse(NANO).unwrap();
        let mut c = nano.clone();
        c.train.batch_size = 0;
        let want = InvalidConfig::OutOfRange { key: "train.batch_size", value: "0".into(), rule: "at least 1" };
        assert_eq!(c.validate(), Err(want));
        let mut c = nano.clone();
        c.schedule.min_lr = 0.5;
        let e = c.validate().unwrap_err();
        assert!(matches!(e, InvalidConfig::Bounded { key: "schedule.min_lr", bound_key: "schedule.lr", .. }), "{e:?}");
        assert_eq!(e.to_string(), "schedule.min_lr (0.5) must not exceed schedule.lr (0.001)");
        let mut c = nano.clone();
        c.schedule.warmup_steps = 5000;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "schedule.warmup_steps (5000) must not exceed schedule.decay_steps (2000)");
        // Without decay_steps the bound is the key it defaults to.
        c.schedule.decay_steps = None;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "schedule.warmup_steps (5000) must not exceed train.max_steps (2000)");
        let mut c = nano.clone();
        c.data.packing = Some(Packing::Stream);
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "data.packing = \"stream\" applies to JSONL examples; this data is a text stream");
        let mut c = nano;
        c.train.max_steps = 1 << 41;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "train.max_steps = 2199023255552 is larger than ember's limit of 1099511627776");
    }
}
