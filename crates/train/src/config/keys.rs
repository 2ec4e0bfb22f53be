//! The keys of a config file, checked over the parsed TOML before serde reads it, so that every
//! unknown, missing or mistyped key is reported at once (serde stops at the first) in the words a
//! user writes: `[train] max_steps is missing`, `line 9: [data] unknown key "trian" — did you mean
//! "train"?`.
//!
//! The keys each section accepts are read from the section structs' own serde derive
//! ([`serde_fields`]), so they cannot drift from the structs; the keys with no default are listed
//! in [`REQUIRED`], which a test checks against what parsing does.

use serde::Deserialize;

use ember_model::{LoraConfig, ModelConfig};

use super::sections::{
    DataConfig, DistributedConfig, EvalTasksConfig, LoopConfig, MetricsConfig, MuonConfig, OptimConfig,
    PreferenceConfig, RlConfig, ScheduleConfig,
};
use super::{InitSource, TrainConfig};
use crate::error::InvalidConfig;
pub use crate::error::{ConfigProblem, Hint, Problem};

/// Keys with no default, by section (a section left out counts as empty). `[model]` may be left
/// out as a whole when `init_from` gives the model; `[lora]` and `[muon]` are optional as a whole.
/// (`train.batch_size` and `lora.alpha` have defaults that follow other keys: `config::defaults`.)
pub(crate) const REQUIRED: &[(&str, &[&str])] = &[
    ("model", &["d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"]),
    ("train", &["max_steps"]),
    ("lora", &["rank"]),
    ("muon", &["lr"]),
    ("eval", &["tasks"]),
];

impl ConfigProblem {
    /// `rule`, at the line of the key it names (or of its section's header).
    pub(crate) fn rule(rule: InvalidConfig, text: &str) -> Self {
        let (section, key) = match &rule {
            InvalidConfig::OutOfRange { key, .. }
            | InvalidConfig::TooLarge { key, .. }
            | InvalidConfig::Bounded { key, .. }
            | InvalidConfig::Needs { key, .. }
            | InvalidConfig::JsonlOnly { key, .. } => {
                key.split_once('.').map_or((Some(*key), None), |(s, k)| (Some(s), Some(k)))
            }
            InvalidConfig::NoData | InvalidConfig::TwoData { .. } => (Some("data"), None),
            InvalidConfig::NoSinks => (Some("metrics"), Some("sinks")),
            InvalidConfig::EvalTasks(_) => (Some("eval"), Some("tasks")),
            InvalidConfig::Rl(_) => (Some("rl"), None),
            InvalidConfig::LoraWithoutInit | InvalidConfig::Lora(_) => (Some("lora"), None),
            InvalidConfig::Model(_) => (Some("model"), None),
            InvalidConfig::NoEffect { section, key, .. } => (Some(*section), *key),
        };
        let line = match (section, key) {
            // A reward, by its place in the list (and its key, where the message names one).
            _ if reward_line(&rule, text).is_some() => reward_line(&rule, text),
            // A table inside a section (`[model.moe]`), or written inline in it (`moe = {…}`).
            (Some(s), None) if s.contains('.') => header_line(text, s).or_else(|| {
                let (parent, name) = s.rsplit_once('.')?;
                key_line(text, Some(parent), name)
            }),
            (Some(s), Some(k)) => key_line(text, Some(s), k),
            (Some(s), None) => header_line(text, s),
            _ => None,
        };
        ConfigProblem { line, section: None, what: Problem::Rule(rule) }
    }
}

/// The line of the reward an `[rl]` rule names (`rewards[1] (kind = "regex"): pattern …`): its
/// key's where the message starts with one that the file writes, else its `[[rl.rewards]]`.
fn reward_line(rule: &InvalidConfig, text: &str) -> Option<usize> {
    use super::toml_path::Seg;
    let InvalidConfig::Rl(message) = rule else { return None };
    let rest = message.strip_prefix("rewards[")?;
    let (index, rest) = rest.split_once(']')?;
    let mut path = vec![Seg::Key("rl".into()), Seg::Key("rewards".into()), Seg::Index(index.parse().ok()?)];
    let what = rest.split_once(": ").map_or("", |(_, w)| w);
    let key = what.trim_start_matches('`').split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next();
    path.extend(key.filter(|k| !k.is_empty()).map(|k| Seg::Key(k.into())));
    super::toml_path::locate(text, &path)
}

/// The sections of a config file: the top-level keys of [`TrainConfig`] but `init_from`.
pub(crate) fn sections() -> Vec<&'static str> {
    top_level().iter().copied().filter(|k| *k != "init_from").collect()
}

fn top_level() -> &'static [&'static str] {
    serde_fields::<TrainConfig<Option<ModelConfig>>>()
}

/// The keys section `name` accepts (`None`: no such section).
pub(crate) fn section_keys(name: &str) -> Option<&'static [&'static str]> {
    Some(match name {
        "model" => serde_fields::<ModelConfig>(),
        "data" => serde_fields::<DataConfig>(),
        "train" => serde_fields::<LoopConfig>(),
        "optim" => serde_fields::<OptimConfig>(),
        "schedule" => serde_fields::<ScheduleConfig>(),
        "lora" => serde_fields::<LoraConfig>(),
        "muon" => serde_fields::<MuonConfig>(),
        "preference" => serde_fields::<PreferenceConfig>(),
        "rl" => serde_fields::<RlConfig>(),
        "eval" => serde_fields::<EvalTasksConfig>(),
        "metrics" => serde_fields::<MetricsConfig>(),
        "distributed" => serde_fields::<DistributedConfig>(),
        _ => return None,
    })
}

/// Reads section `name` alone, as its struct: serde's error for a bad value, with its span in
/// `text` (the section written back as TOML).
pub(super) fn read_section(name: &str, text: &str) -> Result<(), toml::de::Error> {
    match name {
        "model" => toml::from_str::<ModelConfig>(text).map(drop),
        "data" => toml::from_str::<DataConfig>(text).map(drop),
        "train" => toml::from_str::<LoopConfig>(text).map(drop),
        "optim" => toml::from_str::<OptimConfig>(text).map(drop),
        "schedule" => toml::from_str::<ScheduleConfig>(text).map(drop),
        "lora" => toml::from_str::<LoraConfig>(text).map(drop),
        "muon" => toml::from_str::<MuonConfig>(text).map(drop),
        "preference" => toml::from_str::<PreferenceConfig>(text).map(drop),
        "rl" => toml::from_str::<RlConfig>(text).map(drop),
        "eval" => toml::from_str::<EvalTasksConfig>(text).map(drop),
        "metrics" => toml::from_str::<MetricsConfig>(text).map(drop),
        "distributed" => toml::from_str::<DistributedConfig>(text).map(drop),
        _ => Ok(()),
    }
}

/// Every problem with the keys of `table` (the file `text`, parsed): unknown sections and keys
/// (with what they may have meant), required keys left out, values of the wrong type. Unknown
/// keys are taken out of `table`, so that what is left can be read once the list is empty.
pub(crate) fn check(table: &mut toml::Table, text: &str) -> Vec<ConfigProblem> {
    let mut problems = missing(table, text);
    let sections = sections();
    let names: Vec<String> = table.keys().cloned().collect();
    for name in names {
        if name == "init_from" {
            problems.extend(init_from_problem(&table[&name], text));
            continue;
        }
        let Some(keys) = section_keys(&name) else {
            // A key of the top level, or a section: which one the user meant is in the text.
            let is_section = table[&name].is_table();
            let problem = if is_section {
                Problem::UnknownSection { hint: suggest(&name, &sections).map_or(Hint::None, Hint::Section) }
            } else {
                Problem::UnknownKey { key: name.clone(), hint: hint(&name, top_level(), None) }
            };
            let section = is_section.then(|| name.clone());
            let line = if is_section { header_line(text, &name) } else { key_line(text, None, &name) };
            problems.push(ConfigProblem { line, section, what: problem });
            table.remove(&name);
            continue;
        };
        let Some(section) = table.get_mut(&name).and_then(toml::Value::as_table_mut) else {
            let found = table[&name].type_str();
            let line = key_line(text, None, &name);
            problems.push(ConfigProblem { line, section: Some(name.clone()), what: Problem::NotATable { found } });
            table.remove(&name);
            continue;
        };
        let unknown: Vec<String> = section.keys().filter(|k| !keys.contains(&k.as_str())).cloned().collect();
        for key in unknown {
            let what = Problem::UnknownKey { hint: hint(&key, keys, Some(&name)), key: key.clone() };
            problems.push(at(text, Some(&name), Some(&key), what));
            section.remove(&key);
        }
    }
    problems
}

/// The keys of [`REQUIRED`] missing from `table`, `train.max_steps` and `train.num_epochs` both
/// given, and a missing `[data]`.
fn missing(table: &toml::Table, text: &str) -> Vec<ConfigProblem> {
    let mut problems = Vec::new();
    for (name, keys) in REQUIRED {
        let section = match table.get(*name) {
            Some(toml::Value::Table(t)) => t,
            // Optional as a whole (`[model]` is checked once init_from is known), or reported.
            Some(_) => continue,
            None if *name == "train" => &toml::Table::new(),
            None => continue,
        };
        // `train.num_epochs` stands for `max_steps`, and only one of them may be given.
        let epochs = *name == "train" && section.contains_key("num_epochs");
        if epochs && section.contains_key("max_steps") {
            problems.push(at(
                text,
                Some(name),
                Some("num_epochs"),
                Problem::Exclusive { key: "num_epochs", other: "max_steps" },
            ));
        }
        let given = |k: &str| section.contains_key(k) || (epochs && k == "max_steps");
        for key in keys.iter().filter(|k| !given(k)) {
            problems.push(ConfigProblem {
                line: None,
                section: Some(name.to_string()),
                what: Problem::Missing { key: key.to_string() },
            });
        }
    }
    if !table.contains_key("data") {
        problems.push(ConfigProblem {
            line: None,
            section: Some("data".into()),
            what: Problem::MissingSection { needs: "set `dataset` (a built-in name) or `path` (a text or JSONL file)" },
        });
    }
    problems
}

/// What is wrong with `init_from`'s value, if anything.
fn init_from_problem(value: &toml::Value, text: &str) -> Option<ConfigProblem> {
    let key = "init_from";
    let message = match value {
        toml::Value::String(spec) => InitSource::try_from(spec.clone()).err()?.to_string(),
        other => {
            format!("expected a string (`hf:DIR`, `run:DIR` or `gguf:FILE`), found {}", other.type_str())
        }
    };
    Some(at(text, None, Some(key), Problem::BadValue { key: key.into(), message }))
}

/// A problem at `key` of `section` (the section's header where there is no key).
fn at(text: &str, section: Option<&str>, key: Option<&str>, what: Problem) -> ConfigProblem {
    let line = match (section, key) {
        (_, Some(key)) => key_line(text, section, key),
        (Some(section), None) => header_line(text, section),
        (None, None) => None,
    };
    ConfigProblem { line, section: section.map(String::from), what }
}

/// What unknown key `key` of `section` may have meant, in this order: a key of the same section a
/// typo away; the section's key that other trainers name `key` ([`ALIASES`]); the same key,
/// exactly, in another section (the only one that has it; several are named as such, since a name
/// like `beta` means something else in each).
fn hint(key: &str, keys: &[&str], section: Option<&str>) -> Hint {
    if let Some(near) = suggest(key, keys) {
        return Hint::DidYouMean(near);
    }
    if let Some((.., ours)) = ALIASES.iter().find(|(s, theirs, _)| Some(*s) == section && *theirs == key) {
        return Hint::DidYouMean(ours.to_string());
    }
    if let Some((_, home)) = HOMES.iter().find(|(k, _)| *k == key) {
        return Hint::BelongsIn(home.to_string());
    }
    let homes: Vec<String> = sections()
        .into_iter()
        .filter(|s| Some(*s) != section && section_keys(s).is_some_and(|keys| keys.contains(&key)))
        .map(String::from)
        .collect();
    match <[String; 1]>::try_from(homes) {
        Ok([home]) => return Hint::BelongsIn(home),
        Err(homes) if !homes.is_empty() => return Hint::KeyOf(homes),
        Err(_) => {}
    }
    // A section's name written as a key (`model = 1` in [schedule]), or a typo of one.
    if sections().contains(&key) {
        return Hint::IsSection(key.to_string());
    }
    match suggest(key, &sections()) {
        Some(near) => Hint::DidYouMean(near),
        None => Hint::None,
    }
}

/// Names other trainers give a key, by section: `(section, their name, ours)` (PyTorch's Muon and
/// the papers' β for its momentum; PEFT's `LoraConfig`; TRL's and Hugging Face Trainer's
/// arguments), suggested where the name is no key of that section.
const ALIASES: &[(&str, &str, &str)] = &[
    ("muon", "beta", "momentum"),
    ("muon", "mu", "momentum"),
    ("muon", "ns_iters", "ns_steps"),
    ("lora", "r", "rank"),
    ("lora", "lora_alpha", "alpha"),
    ("lora", "lora_dropout", "dropout"),
    ("lora", "target_modules", "targets"),
    ("train", "per_device_train_batch_size", "batch_size"),
    ("train", "gradient_accumulation_steps", "grad_accum_steps"),
    ("train", "num_train_epochs", "num_epochs"),
    ("schedule", "learning_rate", "lr"),
    ("schedule", "lr_scheduler_type", "shape"),
    ("rl", "num_generations", "group_size"),
    ("rl", "max_completion_length", "max_new_tokens"),
    ("preference", "loss_type", "method"),
    ("preference", "gamma", "simpo_gamma"),
    ("preference", "rpo_alpha", "sft_weight"),
];

/// Keys of several sections whose home is plain wherever else they are written: `lr` in `[optim]`,
/// `[train]` or at the top is AdamW's rate, `[schedule] lr` (`[muon] lr` is Muon's own).
const HOMES: &[(&str, &str)] = &[("lr", "schedule")];

/// The candidate nearest to `name`, if it is a typo away: at most one edit for short names, up to
/// a third of the name's length for longer ones (a swap of two letters is one edit).
pub(crate) fn suggest(name: &str, candidates: &[&str]) -> Option<String> {
    let limit = (name.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| (edit_distance(name, c), *c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c.to_string())
}

/// Optimal string alignment distance: insertions, deletions, substitutions and swaps of adjacent
/// characters, each one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.to_lowercase().chars().collect(), b.to_lowercase().chars().collect());
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for j in 0..=b.len() {
        d[0][j] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// 1-based line of the header `[section]` in `text`.
fn header_line(text: &str, section: &str) -> Option<usize> {
    text.lines().position(|l| header(l) == Some(section)).map(|i| i + 1)
}

/// 1-based line of `key = ...` in `section` of `text` (`None`: the top of the file).
fn key_line(text: &str, section: Option<&str>, key: &str) -> Option<usize> {
    let mut current = None;
    for (i, line) in text.lines().enumerate() {
        if let Some(h) = header(line) {
            current = Some(h);
            continue;
        }
        let Some((name, _)) = line.split_once('=') else { continue };
        let name = name.trim().trim_matches(|c| c == '"' || c == '\'');
        if current == section && name == key {
            return Some(i + 1);
        }
    }
    // A table of its own (`[model.rope_scaling]`), or written as a dotted key or an inline table
    // at the top: the line that names it, else its section.
    let nested = match section {
        Some(s) => format!("{s}.{key}"),
        None => key.to_string(),
    };
    header_line(text, &nested).or_else(|| section.and_then(|s| header_line(text, s)))
}

/// The name in a `[section]` header line.
fn header(line: &str) -> Option<&str> {
    let line = line.split('#').next()?.trim();
    let name = line.strip_prefix('[')?.strip_suffix(']')?;
    (!name.starts_with('[')).then(|| name.trim())
}

/// The field names a struct's `Deserialize` derive accepts ([`serde_names`]).
pub(crate) fn serde_fields<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    serde_names::<T>().0
}

/// The field names of a struct's `Deserialize` derive and the variant names of an enum's: the
/// derive asks the deserializer for a struct (an enum) of these names, and this one records them
/// and stops. Empty for what is neither.
pub fn serde_names<'de, T: Deserialize<'de>>() -> (&'static [&'static str], &'static [&'static str]) {
    let mut names: (&'static [&'static str], &'static [&'static str]) = (&[], &[]);
    let _ = T::deserialize(Names(&mut names));
    names
}

struct Names<'a>(&'a mut (&'static [&'static str], &'static [&'static str]));

#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("names read")
    }
}

impl std::error::Error for Stop {}

impl serde::de::Error for Stop {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> serde::Deserializer<'de> for Names<'_> {
    type Error = Stop;

    fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: serde::de::Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        self.0 .0 = fields;
        Err(Stop)
    }

    fn deserialize_enum<V: serde::de::Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        self.0 .1 = variants;
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_names_come_from_the_structs() {
        assert_eq!(
            sections(),
            [
                "model",
                "data",
                "train",
                "optim",
                "schedule",
                "lora",
                "muon",
                "preference",
                "rl",
                "eval",
                "metrics",
                "distributed"
            ],
            "a new section needs its struct in section_keys and read_section"
        );
        for s in sections() {
            assert!(section_keys(s).is_some_and(|k| !k.is_empty()), "{s}");
        }
        assert!(section_keys("train").unwrap().contains(&"eval_interval"));
        assert!(section_keys("schedule").unwrap().contains(&"lr"));
        for (section, keys) in REQUIRED {
            let known = section_keys(section).unwrap();
            assert!(keys.iter().all(|k| known.contains(k)), "{section}: {keys:?}");
        }
    }

    #[test]
    fn suggestions_are_a_typo_away() {
        assert_eq!(edit_distance("trian", "train"), 1);
        assert_eq!(edit_distance("eval_intervl", "eval_interval"), 1);
        assert_eq!(suggest("trian", &sections()).as_deref(), Some("train"));
        assert_eq!(suggest("bath_size", section_keys("train").unwrap()).as_deref(), Some("batch_size"));
        assert_eq!(suggest("zzz", &sections()), None);
        // `lr` is [schedule]'s (AdamW's rate) and [muon]'s; elsewhere it means AdamW's.
        assert_eq!(hint("lr", section_keys("optim").unwrap(), Some("optim")), Hint::BelongsIn("schedule".into()));
        assert_eq!(hint("lr", section_keys("train").unwrap(), Some("train")), Hint::BelongsIn("schedule".into()));
        assert_eq!(hint("max_steps", top_level(), None), Hint::BelongsIn("train".into()));
        // Issue 57: a section's name as a key was "did you mean" itself.
        for (key, section) in [("model", "schedule"), ("rl", "rl"), ("model", "lora")] {
            let found = hint(key, section_keys(section).unwrap(), Some(section));
            assert_eq!(found, Hint::IsSection(key.into()), "{key} in [{section}]");
            assert_eq!(found.to_string(), format!(" — [{key}] is a section: write it as a table header"));
        }
    }

    /// Issue 57: `[muon] beta` was said to belong in [preference] (DPO's β). Muon's β is its
    /// momentum; a key of one other section only is said to belong there; a typo of the section's
    /// own key comes first.
    #[test]
    fn an_unknown_muon_key_is_not_sent_to_another_objective() {
        let muon = section_keys("muon").unwrap();
        assert_eq!(hint("beta", muon, Some("muon")), Hint::DidYouMean("momentum".into()));
        assert_eq!(hint("momentum2", muon, Some("muon")), Hint::DidYouMean("momentum".into()));
        assert_eq!(hint("ns_step", muon, Some("muon")), Hint::DidYouMean("ns_steps".into()));
        assert_eq!(hint("beta1", muon, Some("muon")), Hint::BelongsIn("optim".into()));
        let both = Hint::KeyOf(vec!["preference".into(), "rl".into()]);
        assert_eq!(hint("method", muon, Some("muon")), both);
        assert_eq!(both.to_string(), " — a key of [preference] and [rl], each its own");
        assert_eq!(hint("label_smoothing", muon, Some("muon")), Hint::BelongsIn("preference".into()));
        assert_eq!(hint("lora_alpha", section_keys("lora").unwrap(), Some("lora")), Hint::DidYouMean("alpha".into()));
        // Every alias names a key its section has, and is none itself.
        for (section, theirs, ours) in ALIASES {
            let keys = section_keys(section).unwrap();
            assert!(keys.contains(ours) && !keys.contains(theirs), "[{section}] {theirs} -> {ours}");
        }
    }

    #[test]
    fn lines_of_keys_and_headers() {
        let text = "init_from = \"run:x\"\n[data]\npath = \"a\"\n\n[train] # loop\n max_steps = 3\n\"seed\" = 1\n";
        assert_eq!(key_line(text, None, "init_from"), Some(1));
        assert_eq!(key_line(text, Some("data"), "path"), Some(3));
        assert_eq!(header_line(text, "train"), Some(5));
        assert_eq!(key_line(text, Some("train"), "max_steps"), Some(6));
        assert_eq!(key_line(text, Some("train"), "seed"), Some(7));
        assert_eq!(key_line(text, Some("train"), "path"), Some(5));
        let text = "[model]\nd_model = 8\n[model.rope_scaling]\nfactor = 2.0\n";
        assert_eq!(key_line(text, Some("model"), "rope_scaling"), Some(3));
    }
}
