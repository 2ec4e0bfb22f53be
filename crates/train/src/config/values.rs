//! Values of the wrong type or outside their choices, at any depth: each section is read alone as
//! its struct, and serde's first error is placed by its span in the section written back as TOML
//! (`[mla]`, `[[rewards]]`): a path of keys and list indices (`model.mla.v_dim`,
//! `rl.rewards[1].limit`), found again in the user's file for its line. The value is then taken
//! out (or a stand-in of the right type put in where the struct cannot do without it) and the
//! section read again, so that every bad value is reported once, and nothing else.

use super::keys::{read_section, suggest, REQUIRED};
use super::toml_path::{locate, parent_of, remove_at, render, value_at, written_path, Seg};
use crate::error::{ConfigProblem, Hint, Problem};

/// Examples of the tables an internally tagged enum takes, by key.
const TAGGED_EXAMPLES: &[(&str, &str)] = &[("rope_scaling", "{ type = \"linear\", factor = 2.0 }")];

/// Every value of `table`'s sections (their keys checked: unknown sections and keys are out) of
/// the wrong type or outside its choices, at the line of the key in `text`.
pub(crate) fn check_values(table: &toml::Table, text: &str) -> Vec<ConfigProblem> {
    let mut problems = Vec::new();
    for (name, value) in table {
        let Some(section) = value.as_table() else { continue };
        problems.extend(SectionReading::new(name, section.clone(), text).problems(leaves(value)));
    }
    problems
}

/// One section read again and again, a bad value reported and taken out (or a missing one stood
/// in for) at each reading, until it reads.
struct SectionReading<'a> {
    name: &'a str,
    /// The user's file, for the lines.
    text: &'a str,
    /// The section as it is now: what was reported taken out, what was missing stood in for.
    section: toml::Table,
    required: &'static [&'static str],
    /// Values taken out once reported: a field then missing is stood in for, not reported.
    taken: Vec<Vec<Seg>>,
    found: Vec<ConfigProblem>,
    /// Fields reported missing (their problems' places in `found`), and those an unknown key is a
    /// typo of: `factr` says what `factor is missing` would.
    missing: Vec<(usize, Vec<Seg>)>,
    meant: Vec<Vec<Seg>>,
}

impl<'a> SectionReading<'a> {
    fn new(name: &'a str, section: toml::Table, text: &'a str) -> Self {
        let required = REQUIRED.iter().find(|(s, _)| *s == name).map_or(&[][..], |(_, keys)| keys);
        let (taken, found, missing, meant) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        Self { name, text, section, required, taken, found, missing, meant }
    }

    /// The section's problems, in the order they were found, the missing fields an unknown key
    /// stands for left out. Each round reports a value and takes it out, or stands in for one: two
    /// per value (of `leaves`) at most.
    fn problems(mut self, leaves: usize) -> Vec<ConfigProblem> {
        for _ in 0..2 * leaves + 4 {
            let Ok(written) = toml::to_string(&self.section) else { break };
            let Err(e) = read_section(self.name, &written) else { break };
            let message = e.message().trim().to_string();
            let path = e.span().map(|s| written_path(&written, s.start)).unwrap_or_default();
            let go_on = if let Some(field) = quoted_after(&message, "missing field `") {
                self.missing_field(path, field, e.span().is_some_and(|s| s.start == 0))
            } else if let Some(field) = quoted_after(&message, "unknown field `") {
                self.unknown_field(path, field, &message)
            } else {
                self.bad_value(path, &message)
            };
            if !go_on {
                break;
            }
        }
        let Self { found, missing, meant, .. } = self;
        let dropped: Vec<usize> = missing.iter().filter(|(_, p)| meant.contains(p)).map(|(i, _)| *i).collect();
        found.into_iter().enumerate().filter(|(i, _)| !dropped.contains(i)).map(|(_, p)| p).collect()
    }

    fn report(&mut self, path: &[Seg], what: Problem) {
        self.found.push(problem(self.text, self.name, path, what));
    }

    /// serde's `missing field` at `path` (`at_start`: its span starts the written section); false
    /// where the reading cannot go on.
    fn missing_field(&mut self, mut path: Vec<Seg>, field: String, at_start: bool) -> bool {
        // The section's own field, where its text starts with a table (`[mla]`): the span of the
        // whole starts at that table's header.
        let own = super::keys::section_keys(self.name).is_some_and(|keys| keys.contains(&field.as_str()));
        if own && at_start {
            path.clear();
        }
        let tag = path.clone();
        path.push(Seg::Key(field.clone()));
        // An internally tagged enum without its tag: what it takes (unless the tag was written,
        // and reported).
        if let Some(expected) = tagged_enum(self.name, &tag, &field) {
            if !self.taken.contains(&path) {
                let message = format!("{expected}; found a table without `{field}`");
                self.report(&tag, Problem::BadValue { key: render(&tag), message });
            }
            if !remove_at(&mut self.section, &tag) {
                return false;
            }
            self.taken.push(tag);
            return true;
        }
        // A key of the section left out is either required, and reported by `keys::check` with
        // the other missing ones, or has a default that follows other keys (`defaults::fill`),
        // left out because those are missing or mistyped: reported.
        let reported = path.len() == 1 || self.taken.contains(&path);
        if !reported {
            self.missing.push((self.found.len(), path.clone()));
            self.report(&path, Problem::Missing { key: render(&path) });
        }
        stand_in(self.name, &mut self.section, &path)
    }

    /// serde's `unknown field` at `path` (serde's `message` lists the known ones); false where the
    /// reading cannot go on.
    fn unknown_field(&mut self, mut path: Vec<Seg>, field: String, message: &str) -> bool {
        if path.last() != Some(&Seg::Key(field.clone())) {
            path.push(Seg::Key(field.clone()));
        }
        let near = suggest(&field, &quoted_names(message.split_once("expected").map_or("", |(_, e)| e)));
        // What the unknown key stands for: the key it is a typo of, or the keys of the table it
        // holds (`[model.moe.x]`: moe's keys one table too deep).
        let mut beside = |key: &str| {
            let mut p = path.clone();
            p.pop();
            p.push(Seg::Key(key.to_string()));
            self.meant.push(p);
        };
        if let Some(near) = &near {
            beside(near);
        }
        if let Some(toml::Value::Table(inner)) = value_at(&self.section, &path) {
            inner.keys().for_each(|k| beside(k));
        }
        let hint = near.map_or(Hint::None, Hint::DidYouMean);
        self.report(&path, Problem::UnknownKey { key: render(&path), hint });
        remove_at(&mut self.section, &path)
    }

    /// Any other error of serde's (`message`), at `path`: a value of the wrong type or outside its
    /// choices; false where the reading cannot go on.
    fn bad_value(&mut self, mut path: Vec<Seg>, message: &str) -> bool {
        // Errors without a place (or at the section's start): the key without which this error
        // goes away.
        if path.is_empty() {
            path = self.key_behind(message).map(|k| vec![Seg::Key(k)]).unwrap_or_default();
        }
        // An unknown variant named by a table's key (`adjust_lr = { x = 1 }`): the enum's key.
        if message.starts_with("unknown variant") && value_at(&self.section, &path).is_some_and(|v| !v.is_str()) {
            path.pop();
        }
        // A path into a list ends at its key: the list is what is taken out.
        while matches!(path.last(), Some(Seg::Index(_))) {
            path.pop();
        }
        if path.is_empty() {
            self.report(&[], Problem::BadValue { key: String::new(), message: tidy(message) });
            return false;
        }
        let message = choices(self.name, &self.section, &path, message).unwrap_or_else(|| tidy(message));
        self.report(&path, Problem::BadValue { key: render(&path), message });
        if !remove_at(&mut self.section, &path) {
            return false;
        }
        self.taken.push(path);
        true
    }

    /// The key of the section (not a required one) without which the error `message` goes away.
    fn key_behind(&self, message: &str) -> Option<String> {
        self.section
            .keys()
            .filter(|k| !self.required.contains(&k.as_str()))
            .find(|k| {
                let mut without = self.section.clone();
                without.remove(*k);
                let still = toml::to_string(&without).ok().and_then(|w| read_section(self.name, &w).err());
                still.is_none_or(|e| e.message().trim() != message)
            })
            .cloned()
    }
}

/// The problem `what` at `path` of section `name`: the section is the tables the path goes
/// through (`[model.mla]`), up to a list, whose key and index stay in the key (`[rl]
/// rewards[1].limit`).
fn problem(text: &str, name: &str, path: &[Seg], what: Problem) -> ConfigProblem {
    let mut full = vec![Seg::Key(name.to_string())];
    full.extend(path.iter().cloned());
    let line = locate(text, &full);
    let tables = match path.iter().position(|s| matches!(s, Seg::Index(_))) {
        Some(i) => i.saturating_sub(1),
        None => path.len().saturating_sub(1),
    };
    let mut section = name.to_string();
    for seg in &path[..tables] {
        if let Seg::Key(k) = seg {
            section.push('.');
            section.push_str(k);
        }
    }
    // The key is written relative to the section.
    let what = match what {
        Problem::BadValue { key, message } if !key.is_empty() => {
            Problem::BadValue { key: render(&path[tables..]), message }
        }
        Problem::UnknownKey { hint, .. } => {
            let hint = match hint {
                Hint::DidYouMean(near) => {
                    let mut near_path = path.to_vec();
                    near_path.pop();
                    near_path.push(Seg::Key(near));
                    Hint::DidYouMean(render(&near_path[tables..]))
                }
                other => other,
            };
            Problem::UnknownKey { key: render(&path[tables..]), hint }
        }
        Problem::Missing { .. } => Problem::Missing { key: render(&path[tables..]) },
        other => other,
    };
    ConfigProblem { line, section: Some(section), what }
}

/// The name between backticks after `prefix` in `message`.
fn quoted_after(message: &str, prefix: &str) -> Option<String> {
    let rest = message.strip_prefix(prefix)?;
    Some(rest[..rest.find('`')?].to_string())
}

/// The names between backticks in `text`: serde's list of what it expected.
fn quoted_names(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The number of values in `value`, tables and lists counted with their contents.
fn leaves(value: &toml::Value) -> usize {
    match value {
        toml::Value::Table(t) => 1 + t.values().map(leaves).sum::<usize>(),
        toml::Value::Array(a) => 1 + a.iter().map(leaves).sum::<usize>(),
        _ => 1,
    }
}

/// Puts a value at `path` (a field the struct cannot do without) that reads, so that the rest
/// can be checked: the first of a few of each type that section `name` takes there.
fn stand_in(name: &str, section: &mut toml::Table, path: &[Seg]) -> bool {
    use toml::Value as V;
    let mut candidates = vec![
        V::Integer(1),
        V::Float(1.0),
        V::Boolean(false),
        V::String("?".into()),
        V::Array(Vec::new()),
        V::Table(toml::Table::new()),
    ];
    let mut i = 0;
    while i < candidates.len() {
        let Some((t, key)) = parent_of(section, path) else { return false };
        t.insert(key, candidates[i].clone());
        let error = toml::to_string(&*section).ok().map(|w| (read_section(name, &w).err(), w));
        let Some((error, written)) = error else { return false };
        let Some(e) = error else { return true };
        let mut at = e.span().map(|s| written_path(&written, s.start)).unwrap_or_default();
        if let Some(field) = quoted_after(e.message(), "missing field `") {
            at.push(Seg::Key(field));
        }
        // The error has moved on (one without a place may still be this value's).
        if !at.is_empty() && !at.starts_with(path) {
            return true;
        }
        // A string outside the choices: the first choice, next.
        if let (V::String(_), true) = (&candidates[i], e.message().starts_with("unknown variant")) {
            if let Some(first) = quoted_names(e.message().split_once("expected").map_or("", |(_, x)| x)).first() {
                candidates.insert(i + 1, V::String(first.to_string()));
            }
        }
        i += 1;
    }
    remove_at(section, path);
    false
}

/// Reads section `name` holding nothing but `value` at `path`: serde's message about it (the
/// fields left out are reported after the values).
fn read_with(name: &str, path: &[Seg], value: toml::Value) -> Option<String> {
    let mut inner = value;
    for seg in path.iter().rev() {
        inner = match seg {
            Seg::Key(k) => toml::Value::Table(toml::Table::from_iter([(k.clone(), inner)])),
            Seg::Index(_) => toml::Value::Array(vec![inner]),
        };
    }
    let toml::Value::Table(section) = inner else { return None };
    let written = toml::to_string(&section).ok()?;
    read_section(name, &written).err().map(|e| e.message().trim().to_string())
}

/// The choices of an enum a value at `path` fails to be one of, in words: `expected one of
/// "cosine", "linear", … (a string), found integer 5`; `None` where `message` is about
/// something else.
fn choices(name: &str, section: &toml::Table, path: &[Seg], message: &str) -> Option<String> {
    let value = value_at(section, path)?;
    let found = found(value);
    // An enum's name given as something else than a string (a table names the variant by its key).
    let not_a_name = message.starts_with("wanted string or table")
        || message.starts_with("wanted exactly 1 element")
        || (message.starts_with("unknown variant") && !value.is_str());
    if not_a_name {
        let probe = toml::Value::String("\u{1}".into());
        let list = toml::Value::Array(vec![probe.clone()]);
        for (value, shape) in [(probe, "a string"), (list, "a list of strings")] {
            let m = read_with(name, path, value)?;
            if m.starts_with("unknown variant") {
                let names = quoted_names(m.split_once("expected").map_or("", |(_, e)| e))
                    .iter()
                    .map(|n| format!("\"{n}\""))
                    .collect::<Vec<_>>()
                    .join(", ");
                let of = if shape == "a string" { "one of" } else { "a list of" };
                return Some(format!("expected {of} {names} ({shape}), found {found}"));
            }
        }
        return None;
    }
    if message.contains("expected internally tagged enum") {
        return tagged_enum(name, path, "type").map(|expected| format!("{expected}; found {found}"));
    }
    None
}

/// What an internally tagged enum at `path` (its tag `field`) takes, in words: `expected a table
/// with type = "linear", "llama3" or "yarn" and the keys that type takes, e.g. …`; `None` where
/// `path` is no such enum.
fn tagged_enum(name: &str, path: &[Seg], field: &str) -> Option<String> {
    let Some(Seg::Key(key)) = path.last() else { return None };
    let mut probe = toml::Table::new();
    probe.insert(field.into(), toml::Value::String("\u{1}".into()));
    let m = read_with(name, path, toml::Value::Table(probe))?;
    if !m.starts_with("unknown variant") {
        return None;
    }
    let names: Vec<String> =
        quoted_names(m.split_once("expected").map_or("", |(_, e)| e)).iter().map(|n| format!("\"{n}\"")).collect();
    let names = match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, init)) => format!("{} or {last}", init.join(", ")),
        None => return None,
    };
    let example =
        TAGGED_EXAMPLES.iter().find(|(k, _)| k == key).map(|(_, e)| format!(", e.g. {e}")).unwrap_or_default();
    Some(format!("expected a table with {field} = {names} and the keys that {field} takes{example}"))
}

/// A value in a message: its type, and itself where short.
fn found(value: &toml::Value) -> String {
    match value {
        toml::Value::Table(_) => "a table".into(),
        toml::Value::Float(x) => format!("float {}", float(*x)),
        toml::Value::Datetime(d) => format!("datetime {d}"),
        other => {
            let text = other.to_string();
            match text.chars().count() {
                0..=40 => format!("{} {text}", other.type_str()),
                _ => format!("{} {}…", other.type_str(), text.chars().take(40).collect::<String>()),
            }
        }
    }
}

/// A float as a message prints it: in its shortest form, with an exponent far from 1
/// (`1.7976931348623157e308`, not 309 digits).
pub(crate) fn float(x: f64) -> String {
    let a = x.abs();
    if x.is_finite() && a != 0.0 && !(1e-5..1e15).contains(&a) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// serde's message in the words of a config file: a table for a struct, floats in short, long
/// strings cut.
fn tidy(message: &str) -> String {
    let mut out = message.to_string();
    if let (Some(start), Some(end)) = (out.find("string \"").map(|i| i + "string \"".len()), out.rfind("\", expected"))
    {
        if end > start && out[start..end].chars().count() > 40 {
            let cut: String = out[start..end].chars().take(40).collect();
            out.replace_range(start..end, &format!("{cut}…"));
        }
    }
    if let Some(at) = out.find("expected struct ") {
        out.replace_range(at.., "expected a table");
    }
    if let Some(start) = out.find("floating point `").map(|i| i + "floating point `".len()) {
        if let Some(len) = out[start..].find('`') {
            if let (Ok(x), true) = (out[start..start + len].parse::<f64>(), len > 20) {
                out.replace_range(start..start + len, &float(x));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::NANO;
    use crate::config::ConfigFile;
    use crate::error::TrainError;
    use std::path::Path;

    /// Each problem `text` is refused for, as the user reads them.
    fn problems(text: &str) -> Vec<String> {
        match ConfigFile::parse(text, Path::new("c.toml")) {
            Err(TrainError::Problems { problems, .. }) => problems.iter().map(ToString::to_string).collect(),
            other => panic!("expected key problems, got {other:?}"),
        }
    }

    fn line_of(text: &str, needle: &str) -> usize {
        text.lines().position(|l| l == needle).unwrap_or_else(|| panic!("no line {needle:?}")) + 1
    }

    /// NANO with latent attention (its v_dim `v_dim`) and experts.
    fn latent(v_dim: &str) -> String {
        format!(
            "{NANO}\n[model.mla]\nq_rank = 64\nkv_rank = 32\nnope_dim = 24\nrope_dim = 8\nv_dim = {v_dim}\n\n\
             [model.moe]\nn_experts = 4\ntop_k = 2\nd_expert = 86\n"
        )
    }

    /// Issue 57: a bad value of a key with a default (`batch_size`, `alpha`) was reported with a
    /// `missing field` for every other key of its section.
    #[test]
    fn a_bad_value_of_a_key_with_a_default_is_its_only_problem() {
        let text = NANO.replace("batch_size = 12", "batch_size = \"x\"");
        let want = format!(
            "line {}: [train] batch_size: invalid type: string \"x\", expected usize",
            line_of(&text, "batch_size = \"x\"")
        );
        assert_eq!(problems(&text), [want]);
        let text = format!("init_from = \"run:/m\"\n{NANO}\n[lora]\nrank = 8\nalpha = \"x\"\ntargets = 3\n");
        assert_eq!(
            problems(&text),
            [
                format!(
                    "line {}: [lora] alpha: invalid type: string \"x\", expected f64",
                    line_of(&text, "alpha = \"x\"")
                ),
                format!(
                    "line {}: [lora] targets: invalid type: integer `3`, expected a sequence",
                    line_of(&text, "targets = 3")
                ),
            ]
        );
        // A required key left out still leaves the other values checked, and is reported once.
        let text = NANO.replace("max_steps = 2000\n", "").replace("seed = 1337", "seed = true");
        let found = problems(&text);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].contains("[train] seed: invalid type: boolean `true`")
                && found[1] == "[train] max_steps is missing"
        );
    }

    /// Issue 57: a value in a nested table was blamed on the table at its header line, a table
    /// one level too deep was reported twice, an enum table without its tag once per table.
    #[test]
    fn a_nested_key_is_named_in_its_table_at_its_line() {
        let text = latent("true");
        let want = format!(
            "line {}: [model.mla] v_dim: invalid type: boolean `true`, expected usize",
            line_of(&text, "v_dim = true")
        );
        assert_eq!(problems(&text), [want]);
        // Written inline, at the line that holds it.
        let text = NANO.replace("tie_embeddings = false", "tie_embeddings = false\nmla = { q_rank = \"x\" }");
        let found = problems(&text);
        let at = line_of(&text, "mla = { q_rank = \"x\" }");
        assert_eq!(found[0], format!("line {at}: [model.mla] q_rank: invalid type: string \"x\", expected usize"));
        // `[model.moe.x]`: the unknown key, once (the keys it holds are moe's).
        let text = latent("32").replace("[model.moe]", "[model.moe.x]");
        assert_eq!(
            problems(&text),
            [format!("line {}: [model.moe] unknown key \"x\"", line_of(&text, "[model.moe.x]"))]
        );
        // A table of [model] alone: the model's keys left out are the model's, not the table's.
        let text = format!("[model.mla]\nq_rank = 64\n[data]\ndataset = \"tinyshakespeare\"\n[train]\nmax_steps = 3\n");
        let found = problems(&text);
        assert!(found.iter().any(|p| p == "[model] d_model is missing"), "{found:?}");
        assert!(found.iter().all(|p| !p.contains("[model.mla] d_model")), "{found:?}");
        // rope_scaling without its type: what it takes, once.
        let text =
            latent("32").replace("tie_embeddings = false", "tie_embeddings = false\nrope_scaling = { factor = 2.0 }");
        let want = format!(
            "line {}: [model] rope_scaling: expected a table with type = \"linear\", \"llama3\" or \"yarn\" and the keys \
             that type takes, e.g. {{ type = \"linear\", factor = 2.0 }}; found a table without `type`",
            line_of(&text, "rope_scaling = { factor = 2.0 }")
        );
        assert_eq!(problems(&text), [want]);
        let text = NANO.replace("tie_embeddings = false", "tie_embeddings = false\nrope_scaling = { type = \"lin\" }");
        let found = problems(&text);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("[model.rope_scaling] type: unknown variant `lin`"), "{found:?}");
    }

    /// Issue 57: problems of `[[rl.rewards]]` carried no line and no index.
    #[test]
    fn a_reward_is_named_by_its_index_and_line() {
        let rl = |rewards: &str| format!("init_from = \"run:/m\"\n{NANO}\n{rewards}");
        let text = rl("[[rl.rewards]]\nkind = \"length\"\nlimit = 5\n\n[[rl.rewards]]\nkind = \"length\"\nlimt = 5\nweight = \"x\"\n");
        assert_eq!(
            problems(&text),
            [
                format!(
                    "line {}: [rl] unknown key \"rewards[1].limt\" — did you mean \"rewards[1].limit\"?",
                    line_of(&text, "limt = 5")
                ),
                format!(
                    "line {}: [rl] rewards[1].weight: invalid type: string \"x\", expected f64",
                    line_of(&text, "weight = \"x\"")
                ),
            ]
        );
        let text = rl("[[rl.rewards]]\nkind = \"length\"\nlimit = 5\n\n[[rl.rewards]]\nkind = \"bogus\"\n");
        let found = problems(&text);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with(&format!(
            "line {}: [rl] rewards[1].kind: unknown variant `bogus`",
            line_of(&text, "kind = \"bogus\"")
        )));
        // A rule broken by a reward, alone: at the reward's line too.
        let text = rl("[[rl.rewards]]\nkind = \"length\"\nlimit = 5\n\n[[rl.rewards]]\nkind = \"regex\"\n")
            .replace("dataset = \"tinyshakespeare\"\ntokenizer = \"char\"", "path = \"prompts.jsonl\"");
        let e = ConfigFile::parse(&text, Path::new("c.toml")).unwrap_err().to_string();
        let header = text.lines().enumerate().filter(|(_, l)| *l == "[[rl.rewards]]").nth(1).unwrap().0 + 1;
        assert_eq!(e, format!("c.toml: line {header}: rl: rewards[1] (kind = \"regex\"): `pattern` is missing"));
    }

    /// Issue 57: an enum's key given a number said only `wanted string or table`; rope_scaling
    /// `expected internally tagged enum RopeScaling`; a huge float printed 309 digits.
    #[test]
    fn a_choice_is_named_with_its_choices() {
        let text = NANO.replace("[schedule]", "[schedule]\nshape = 5");
        let want = "[schedule] shape: expected one of \"cosine\", \"wsd\" (a string), found integer 5";
        assert_eq!(problems(&text), [format!("line {}: {want}", line_of(&text, "shape = 5"))]);
        let text = NANO.replace("tie_embeddings = false", "tie_embeddings = false\nrope_scaling = 5");
        let found = problems(&text);
        assert!(found[0].contains("[model] rope_scaling: expected a table with type = \"linear\""), "{found:?}");
        assert!(found[0].ends_with("found integer 5"), "{found:?}");
        let text = format!("init_from = \"run:/m\"\n{NANO}\n[lora]\nrank = 8\ntargets = [5]\n");
        assert!(problems(&text)[0].contains("targets: expected a list of \"q_proj\", \"k_proj\""));
        let text = NANO.replace("min_lr = 1e-4", "min_lr = 1.7976931348623157e308");
        let e = ConfigFile::parse(&text, Path::new("c.toml")).unwrap_err().to_string();
        assert_eq!(e, "c.toml: schedule.min_lr (1.7976931348623157e308) must not exceed schedule.lr (0.001)");
        let text = NANO.replace("d_model = 128", "d_model = 1e300");
        assert!(problems(&text)[0].ends_with("d_model: invalid type: floating point `1e300`, expected usize"));
    }

    #[test]
    fn floats_print_short() {
        assert_eq!(float(f64::MAX), "1.7976931348623157e308");
        assert_eq!(float(1e-300), "1e-300");
        assert_eq!(float(0.001), "0.001");
        assert_eq!(float(2.5), "2.5");
        assert_eq!(float(0.0), "0");
        assert_eq!(
            tidy("invalid type: floating point `1e308`, expected usize"),
            "invalid type: floating point `1e308`, expected usize"
        );
        assert_eq!(
            tidy("invalid type: integer `1`, expected struct MoeConfig"),
            "invalid type: integer `1`, expected a table"
        );
    }
}
