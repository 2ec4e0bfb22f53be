//! Keys that do something only in some configs, and the one rule about them: a key the file writes
//! where it has no effect is refused, naming the key, where it stands and why (`[preference]
//! simpo_gamma has no effect with method = "dpo" (only simpo uses it); remove it`). A key left out
//! is never refused: only the keys the file writes are looked at ([`written`]), so the defaults
//! (and the run directory's copy, which leaves such keys out at their defaults) pass.
//!
//! Keys whose value alone breaks a rule (`data.packing` on a text stream, `qk_norm_whole` without
//! `qk_norm`, a reward's key of another kind) are refused by the rules of [`super::validate`] and
//! the model's; this table holds the keys that are valid values but idle where they stand.

use std::collections::BTreeSet;

use ember_model::{ModelConfig, Positions};

use super::sections::{EvalStrategy, PreferenceMethod, ScheduleShape};
use super::TrainConfig;
use crate::error::InvalidConfig;

/// The config as parsed: `[model]` may be left out for `init_from`'s.
type Parsed = TrainConfig<Option<ModelConfig>>;

/// A key (or a section) that has an effect only in some configs.
pub(crate) struct Conditional {
    /// The section: `preference`, or `model.moe` for a table inside one.
    pub section: &'static str,
    /// The key; `None`: the section as a whole.
    pub key: Option<&'static str>,
    /// Where the key has no effect: `Some("with method = \"dpo\"")`; `None` where it has one.
    pub idle: fn(&Parsed) -> Option<String>,
    /// Why: "only simpo uses it".
    pub reason: &'static str,
    /// What to do instead.
    pub fix: &'static str,
}

impl Conditional {
    /// The dotted path of the key as [`written`] lists it: `preference.simpo_gamma`, `model.moe`.
    pub(crate) fn path(&self) -> String {
        match self.key {
            Some(key) => format!("{}.{key}", self.section),
            None => self.section.to_string(),
        }
    }
}

const REMOVE: &str = "remove it";

/// Every key with a conditional effect, and where it has none.
pub(crate) const CONDITIONAL: &[Conditional] = &[
    Conditional {
        section: "preference",
        key: Some("simpo_gamma"),
        idle: |c| method_not(c, &[PreferenceMethod::Simpo]),
        reason: "only simpo uses it",
        fix: REMOVE,
    },
    Conditional {
        section: "preference",
        key: Some("label_smoothing"),
        idle: |c| method_not(c, &[PreferenceMethod::Dpo, PreferenceMethod::Simpo]),
        reason: "only dpo and simpo use it",
        fix: REMOVE,
    },
    Conditional {
        section: "data",
        key: Some("packing"),
        idle: |c| c.preference.as_ref().map(|_| "with [preference]".into()),
        reason: "each pair takes a row of its own",
        fix: REMOVE,
    },
    Conditional {
        section: "data",
        key: Some("packing"),
        idle: |c| c.rl.as_ref().map(|_| "with [rl]".into()),
        reason: "each prompt takes a row of its own",
        fix: REMOVE,
    },
    Conditional {
        section: "data",
        key: Some("truncate"),
        idle: |c| c.preference.as_ref().map(|_| "with [preference]".into()),
        reason: "pairs are never cut: one longer than train.seq_len is an error naming its line",
        fix: REMOVE,
    },
    Conditional {
        section: "data",
        key: Some("truncate"),
        idle: |c| c.rl.as_ref().map(|_| "with [rl]".into()),
        reason: "prompts are never cut",
        fix: REMOVE,
    },
    Conditional {
        section: "train",
        key: Some("eval_interval"),
        idle: |c| (c.train.eval_strategy == EvalStrategy::Epoch).then(|| "with eval_strategy = \"epoch\"".into()),
        reason: "evaluations follow the epochs",
        fix: REMOVE,
    },
    Conditional {
        section: "schedule",
        key: Some("cooldown_frac"),
        idle: |c| (c.schedule.shape == ScheduleShape::Cosine).then(|| "with shape = \"cosine\"".into()),
        reason: "only the wsd schedule cools down",
        fix: "remove it, or set shape = \"wsd\"",
    },
    Conditional {
        section: "muon",
        key: None,
        idle: |c| match (&c.lora, &c.muon) {
            (Some(_), Some(muon)) if !muon.lora => Some("with [lora]".into()),
            _ => None,
        },
        reason: "the base weights are frozen and Muon trains only the blocks' matrices: it would train nothing",
        fix: "set lora = true in [muon] to train the adapters with Muon, or remove [muon]",
    },
    Conditional {
        section: "muon",
        key: Some("lora"),
        idle: |c| c.lora.is_none().then(|| "without [lora]".into()),
        reason: "it puts LoRA's adapters under Muon, and there are none",
        fix: REMOVE,
    },
    Conditional {
        section: "metrics",
        key: Some("sample_prompt"),
        idle: |c| (c.metrics.sample_tokens == 0).then(|| "with sample_tokens = 0".into()),
        reason: "no text is sampled",
        fix: REMOVE,
    },
    Conditional {
        section: "eval",
        key: Some("seed"),
        idle: |c| c.eval.as_ref().filter(|e| e.num_fewshot == Some(0)).map(|_| "with num_fewshot = 0".into()),
        reason: "it seeds the draws of few-shot exemplars, and none are drawn",
        fix: REMOVE,
    },
    Conditional { section: "model", key: Some("rope_theta"), idle: learned, reason: NO_ROPE, fix: REMOVE },
    Conditional { section: "model", key: Some("rope_layout"), idle: learned, reason: NO_ROPE, fix: REMOVE },
    Conditional { section: "model", key: Some("rope_scaling"), idle: learned, reason: NO_ROPE, fix: REMOVE },
    Conditional { section: "model", key: Some("rope_local_theta"), idle: learned, reason: NO_ROPE, fix: REMOVE },
    Conditional {
        section: "model",
        key: Some("n_kv_heads"),
        idle: latent,
        reason: "latent attention gives every query head its own key and value, read from the latent",
        fix: REMOVE,
    },
    Conditional {
        section: "model",
        key: Some("head_dim"),
        idle: latent,
        reason: "latent attention's heads take their widths from nope_dim, rope_dim and v_dim",
        fix: REMOVE,
    },
    Conditional {
        section: "model.moe",
        key: None,
        idle: |c| {
            let m = c.model.as_ref()?;
            let moe = m.moe.as_ref().filter(|moe| moe.dense_layers >= m.n_layers)?;
            Some(format!("with dense_layers = {} and n_layers = {}", moe.dense_layers, m.n_layers))
        },
        reason: "every layer keeps the dense MLP: no layer runs the experts",
        fix: "lower dense_layers below n_layers, or remove [model.moe]",
    },
];

const NO_ROPE: &str = "a learned table of positions replaces RoPE";

fn learned(c: &Parsed) -> Option<String> {
    c.model.as_ref().filter(|m| m.positions == Positions::Learned).map(|_| "with positions = \"learned\"".into())
}

fn latent(c: &Parsed) -> Option<String> {
    c.model.as_ref().filter(|m| m.mla.is_some()).map(|_| "with [model.mla]".into())
}

/// `with method = "..."` where `[preference]`'s method is none of `uses`.
fn method_not(c: &Parsed, uses: &[PreferenceMethod]) -> Option<String> {
    let method = c.preference.as_ref()?.method;
    (!uses.contains(&method)).then(|| format!("with method = \"{method}\""))
}

/// The dotted paths of the keys and tables a parsed file writes, down to the keys of a table
/// inside a section (`model.moe.top_k`); arrays of tables (`[[rl.rewards]]`) are not entered.
pub(crate) fn written(table: &toml::Table) -> BTreeSet<String> {
    fn walk(table: &toml::Table, prefix: &str, depth: usize, out: &mut BTreeSet<String>) {
        for (key, value) in table {
            let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
            if let (Some(inner), true) = (value.as_table(), depth < 2) {
                walk(inner, &path, depth + 1, out);
            }
            out.insert(path);
        }
    }
    let mut out = BTreeSet::new();
    walk(table, "", 0, &mut out);
    out
}

impl Parsed {
    /// The keys of `written` that have no effect in this config, each refused with its reason.
    pub(crate) fn idle_keys(&self, written: &BTreeSet<String>) -> Vec<InvalidConfig> {
        CONDITIONAL
            .iter()
            .filter(|k| written.contains(&k.path()))
            .filter_map(|k| {
                let when = (k.idle)(self)?;
                Some(InvalidConfig::NoEffect { section: k.section, key: k.key, when, reason: k.reason, fix: k.fix })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigFile;
    use crate::error::TrainError;
    use std::path::Path;

    const BASE: &str = "init_from = \"run:/m\"\n[data]\npath = \"d.jsonl\"\n[train]\nmax_steps = 20\n";
    const MODEL: &str = "[model]\nd_model = 64\nn_layers = 2\nn_heads = 4\nd_ff = 128\nmax_seq_len = 64\n";
    const MLA: &str = "[model.mla]\nkv_rank = 16\nnope_dim = 8\nrope_dim = 8\nv_dim = 8\n";
    const MOE: &str = "[model.moe]\nn_experts = 4\ntop_k = 2\nd_expert = 32\n";
    const RL: &str = "[rl]\n[[rl.rewards]]\nkind = \"length\"\nlimit = 10\n";

    /// For each entry of [`CONDITIONAL`], in order: a config where its key has an effect, and one
    /// where it has none, both writing the key (a section may be written twice: see [`merge`]).
    fn cases() -> Vec<(&'static str, String, String)> {
        let pref = |m: &str, extra: &str| format!("{BASE}[lora]\nrank = 8\n[preference]\nmethod = \"{m}\"\n{extra}");
        let model = |extra: &str, sub: &str| format!("{BASE}{MODEL}{extra}{sub}");
        let learned = "positions = \"learned\"\n";
        let local = "sliding_window = 16\nsliding_window_pattern = 2\nrope_local_theta = 1e4\n";
        let sft = |extra: &str| format!("{BASE}{extra}");
        vec![
            ("preference.simpo_gamma", pref("simpo", "simpo_gamma = 1.0\n"), pref("dpo", "simpo_gamma = 1.0\n")),
            (
                "preference.label_smoothing",
                pref("dpo", "label_smoothing = 0.1\n"),
                pref("ipo", "label_smoothing = 0.1\n"),
            ),
            ("data.packing", sft("[data]\npacking = \"none\"\n"), pref("dpo", "[data]\npacking = \"none\"\n")),
            ("data.packing", sft("[data]\npacking = \"none\"\n"), sft(&format!("[data]\npacking = \"none\"\n{RL}"))),
            ("data.truncate", sft("[data]\ntruncate = true\n"), pref("dpo", "[data]\ntruncate = true\n")),
            ("data.truncate", sft("[data]\ntruncate = true\n"), sft(&format!("[data]\ntruncate = true\n{RL}"))),
            ("train.eval_interval", sft("eval_interval = 5\n"), sft("eval_interval = 5\neval_strategy = \"epoch\"\n")),
            (
                "schedule.cooldown_frac",
                sft("[schedule]\nshape = \"wsd\"\ncooldown_frac = 0.2\n"),
                sft("[schedule]\ncooldown_frac = 0.2\n"),
            ),
            ("muon", sft("[muon]\nlr = 0.02\n"), sft("[lora]\nrank = 8\n[muon]\nlr = 0.02\n")),
            (
                "muon.lora",
                sft("[lora]\nrank = 8\n[muon]\nlr = 0.02\nlora = true\n"),
                sft("[muon]\nlr = 0.02\nlora = true\n"),
            ),
            (
                "metrics.sample_prompt",
                sft("[metrics]\nsample_prompt = \"Hi\"\n"),
                sft("[metrics]\nsample_tokens = 0\nsample_prompt = \"Hi\"\n"),
            ),
            (
                "eval.seed",
                sft("[eval]\ntasks = [\"piqa:4\"]\nnum_fewshot = 2\nseed = 7\n"),
                sft("[eval]\ntasks = [\"piqa:4\"]\nnum_fewshot = 0\nseed = 7\n"),
            ),
            ("model.rope_theta", model("rope_theta = 5e5\n", ""), model(&format!("rope_theta = 5e5\n{learned}"), "")),
            (
                "model.rope_layout",
                model("rope_layout = \"interleaved\"\n", ""),
                model(&format!("rope_layout = \"interleaved\"\n{learned}"), ""),
            ),
            (
                "model.rope_scaling",
                model("", "[model.rope_scaling]\ntype = \"linear\"\nfactor = 2.0\n"),
                model(learned, "[model.rope_scaling]\ntype = \"linear\"\nfactor = 2.0\n"),
            ),
            ("model.rope_local_theta", model(local, ""), model(&format!("{local}{learned}"), "")),
            ("model.n_kv_heads", model("n_kv_heads = 2\n", ""), model("n_kv_heads = 2\n", MLA)),
            ("model.head_dim", model("head_dim = 8\n", ""), model("head_dim = 8\n", MLA)),
            (
                "model.moe",
                model("", &format!("{MOE}dense_layers = 1\n")),
                model("", &format!("{MOE}dense_layers = 2\n")),
            ),
        ]
    }

    fn parse(text: &str) -> Result<ConfigFile, TrainError> {
        ConfigFile::parse(text, Path::new("c.toml"))
    }

    /// The run directory's copy of `file`'s config (a small model where the file names none).
    fn resolved(file: ConfigFile) -> String {
        let model = file.config.model.clone().unwrap_or_else(|| ModelConfig::tiny(0, 64));
        file.complete_with(model).unwrap_or_else(|e| panic!("{e}")).to_toml()
    }

    #[test]
    fn every_conditional_key_is_refused_where_it_has_no_effect_and_only_there() {
        let cases = cases();
        assert_eq!(cases.len(), CONDITIONAL.len(), "a case for every entry, in the table's order");
        for (entry, (path, on, off)) in CONDITIONAL.iter().zip(cases) {
            assert_eq!(entry.path(), path);
            let (on, off) = (merge(&on), merge(&off));
            // Where it has an effect: taken, and the run directory's copy reads back as a file.
            let parsed = parse(&on).unwrap_or_else(|e| panic!("{path} where it has an effect: {e}\n{on}"));
            assert!(written(&toml::from_str(&on).unwrap()).contains(path), "{path}: {on}");
            let saved = resolved(parsed);
            parse(&saved).unwrap_or_else(|e| panic!("{path}: the resolved copy is refused: {e}\n{saved}"));
            // Where it has none: refused at its line, with the reason.
            let e = parse(&off).map(drop).expect_err(&format!("{path} where it has no effect:\n{off}")).to_string();
            let name = match entry.key {
                Some(k) => format!("[{}] {k} ", entry.section),
                None => format!("[{}] ", entry.section),
            };
            let want = format!("c.toml: line {}: {name}has no effect ", key_line_of(&off, entry));
            assert!(e.starts_with(&want), "{path}: {e}\nwanted {want}…\n{off}");
            assert!(e.ends_with(&format!("({}); {}", entry.reason, entry.fix)), "{path}: {e}");
            // Left out, the same config is taken, and so is its run directory's copy.
            let without = remove(&off, entry);
            let parsed = parse(&without).unwrap_or_else(|e| panic!("{path} left out: {e}\n{without}"));
            let saved = resolved(parsed);
            parse(&saved).unwrap_or_else(|e| panic!("{path} left out: the resolved copy is refused: {e}\n{saved}"));
        }
    }

    /// `text` with each section written once: the cases add keys to the base's sections by
    /// writing them again, which TOML refuses.
    fn merge(text: &str) -> String {
        let mut sections: Vec<(String, String)> = vec![(String::new(), String::new())];
        let mut current = String::new();
        for line in text.lines() {
            if line.starts_with('[') {
                current = line.to_string();
                if !sections.iter().any(|(h, _)| *h == current) {
                    sections.push((current.clone(), String::new()));
                }
                continue;
            }
            if let Some((_, body)) = sections.iter_mut().find(|(h, _)| *h == current) {
                body.push_str(line);
                body.push('\n');
            }
        }
        sections.iter().map(|(h, b)| if h.is_empty() { b.clone() } else { format!("{h}\n{b}") }).collect()
    }

    /// 1-based line of the entry's key (or of its section's header) in `text`.
    fn key_line_of(text: &str, entry: &Conditional) -> usize {
        let mut section = "";
        for (i, line) in text.lines().enumerate() {
            if let Some(h) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = h;
                if h == entry.path() {
                    return i + 1;
                }
            } else if section == entry.section && entry.key.is_some_and(|k| line.starts_with(&format!("{k} ="))) {
                return i + 1;
            }
        }
        panic!("{} is not in\n{text}", entry.path())
    }

    /// `text` without the entry's key (or its whole section, and the tables inside it).
    fn remove(text: &str, entry: &Conditional) -> String {
        let mut section = String::new();
        let mut out = String::new();
        for line in text.lines() {
            if let Some(h) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = h.to_string();
            }
            let path = entry.path();
            let table = section == path || section.starts_with(&format!("{path}."));
            let key = section == entry.section && entry.key.is_some_and(|k| line.starts_with(&format!("{k} =")));
            if !(table || key) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    #[test]
    fn written_keys_are_told_apart_from_defaults() {
        let text = "[data]\npath = \"a\"\n[model]\nd_model = 8\n[model.moe]\ntop_k = 2\n[[rl.rewards]]\nkind = \"x\"\n";
        let w = written(&toml::from_str(text).unwrap());
        let want = ["data", "data.path", "model", "model.d_model", "model.moe", "model.moe.top_k", "rl", "rl.rewards"];
        assert_eq!(w.iter().map(String::as_str).collect::<Vec<_>>(), want);
        // A DPO config that leaves simpo_gamma out is taken, with its default.
        let c = parse(&format!("{BASE}[lora]\nrank = 8\n[preference]\nmethod = \"dpo\"\n")).unwrap();
        assert_eq!(c.config.preference.map(|p| p.simpo_gamma), Some(0.5));
    }
}
