//! Values of the wrong type or outside their choices, at any depth: each section is read alone as
//! its struct, and serde's first error is placed by its span in the section written back as TOML
//! (`[mla]`, `[[rewards]]`): a path of keys and list indices (`model.mla.v_dim`,
//! `rl.rewards[1].limit`), found again in the user's file for its line. The value is then taken
//! out (or a stand-in of the right type put in where the struct cannot do without it) and the
//! section read again, so that every bad value is reported once, and nothing else.

use super::keys::{read_section, suggest, REQUIRED};
use crate::error::{ConfigProblem, Hint, Problem};

/// One step of a path into a section: a key of a table, or an element of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

/// Examples of the tables an internally tagged enum takes, by key.
const TAGGED_EXAMPLES: &[(&str, &str)] = &[("rope_scaling", "{ type = \"linear\", factor = 2.0 }")];

/// Every value of `table`'s sections (their keys checked: unknown sections and keys are out) of
/// the wrong type or outside its choices, at the line of the key in `text`.
pub(crate) fn check_values(table: &toml::Table, text: &str) -> Vec<ConfigProblem> {
    let mut problems = Vec::new();
    for (name, value) in table {
        let Some(section) = value.as_table() else { continue };
        let mut section = section.clone();
        let required = REQUIRED.iter().find(|(s, _)| s == name).map_or(&[][..], |(_, keys)| keys);
        // Values taken out once reported: a field then missing is stood in for, not reported.
        let mut taken: Vec<Vec<Seg>> = Vec::new();
        // Fields reported missing (their problems' places in `found`), and those an unknown key
        // is a typo of: `factr` says what `factor is missing` would.
        let (mut found, mut missing, mut meant) = (Vec::new(), Vec::new(), Vec::new());
        // Each round reports a value and takes it out, or stands in for one: two per value at most.
        let rounds = 2 * leaves(value) + 4;
        for _ in 0..rounds {
            let Ok(written) = toml::to_string(&section) else { break };
            let Err(e) = read_section(name, &written) else { break };
            let message = e.message().trim().to_string();
            let mut path = e.span().map(|s| written_path(&written, s.start)).unwrap_or_default();
            if let Some(field) = quoted_after(&message, "missing field `") {
                // The section's own field, where its text starts with a table (`[mla]`): the
                // span of the whole starts at that table's header.
                let own = super::keys::section_keys(name).is_some_and(|keys| keys.contains(&field.as_str()));
                if own && e.span().is_some_and(|s| s.start == 0) {
                    path.clear();
                }
                let tag = path.clone();
                path.push(Seg::Key(field.clone()));
                // An internally tagged enum without its tag: what it takes (unless the tag was
                // written, and reported).
                if let Some(expected) = tagged_enum(name, &tag, &field) {
                    if !taken.contains(&path) {
                        let message = format!("{expected}; found a table without `{field}`");
                        found.push(problem(text, name, &tag, Problem::BadValue { key: render(&tag), message }));
                    }
                    if !remove_at(&mut section, &tag) {
                        break;
                    }
                    taken.push(tag);
                    continue;
                }
                // A key of the section left out is either required, and reported by `keys::check`
                // with the other missing ones, or has a default that follows other keys
                // (`defaults::fill`), left out because those are missing or mistyped: reported.
                let reported = path.len() == 1 || taken.contains(&path);
                if !reported {
                    missing.push((found.len(), path.clone()));
                    found.push(problem(text, name, &path, Problem::Missing { key: render(&path) }));
                }
                if stand_in(name, &mut section, &path) {
                    continue;
                }
                break;
            }
            if let Some(field) = quoted_after(&message, "unknown field `") {
                if path.last() != Some(&Seg::Key(field.clone())) {
                    path.push(Seg::Key(field.clone()));
                }
                let near = suggest(&field, &quoted_names(message.split_once("expected").map_or("", |(_, e)| e)));
                // What the unknown key stands for: the key it is a typo of, or the keys of the
                // table it holds (`[model.moe.x]`: moe's keys one table too deep).
                let mut beside = |key: &str| {
                    let mut p = path.clone();
                    p.pop();
                    p.push(Seg::Key(key.to_string()));
                    meant.push(p);
                };
                if let Some(near) = &near {
                    beside(near);
                }
                if let Some(toml::Value::Table(inner)) = value_at(&section, &path) {
                    inner.keys().for_each(|k| beside(k));
                }
                let hint = near.map_or(Hint::None, Hint::DidYouMean);
                found.push(problem(text, name, &path, Problem::UnknownKey { key: render(&path), hint }));
                if !remove_at(&mut section, &path) {
                    break;
                }
                continue;
            }
            // Errors without a place (or at the section's start): the key without which this
            // error goes away.
            if path.is_empty() {
                path = section
                    .keys()
                    .filter(|k| !required.contains(&k.as_str()))
                    .find(|k| {
                        let mut without = section.clone();
                        without.remove(*k);
                        let still = toml::to_string(&without).ok().and_then(|w| read_section(name, &w).err());
                        still.is_none_or(|e| e.message().trim() != message)
                    })
                    .map(|k| vec![Seg::Key(k.clone())])
                    .unwrap_or_default();
            }
            // An unknown variant named by a table's key (`adjust_lr = { x = 1 }`): the enum's key.
            if message.starts_with("unknown variant") && value_at(&section, &path).is_some_and(|v| !v.is_str()) {
                path.pop();
            }
            // A path into a list ends at its key: the list is what is taken out.
            while matches!(path.last(), Some(Seg::Index(_))) {
                path.pop();
            }
            if path.is_empty() {
                found.push(problem(text, name, &[], Problem::BadValue { key: String::new(), message: tidy(&message) }));
                break;
            }
            let message = choices(name, &section, &path, &message).unwrap_or_else(|| tidy(&message));
            found.push(problem(text, name, &path, Problem::BadValue { key: render(&path), message }));
            if !remove_at(&mut section, &path) {
                break;
            }
            taken.push(path);
        }
        let dropped: Vec<usize> = missing.iter().filter(|(_, p)| meant.contains(p)).map(|(i, _)| *i).collect();
        problems.extend(found.into_iter().enumerate().filter(|(i, _)| !dropped.contains(i)).map(|(_, p)| p));
    }
    problems
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

/// `a.b[1].c`.
fn render(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) if out.is_empty() => out.push_str(k),
            Seg::Key(k) => {
                out.push('.');
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
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

/// Splits a TOML key (`a.b`, `"a.b".c`) into its parts, quotes taken off.
fn split_key(key: &str) -> Vec<String> {
    let (mut parts, mut part, mut quote) = (Vec::new(), String::new(), None);
    let mut chars = key.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            (Some('"'), '\\') => part.extend(chars.next()),
            (None, '.') => parts.push(std::mem::take(&mut part).trim().to_string()),
            _ => part.push(c),
        }
    }
    parts.push(part.trim().to_string());
    parts
}

/// The header of a `[table]` or `[[list of tables]]` line: its path and whether it is a list.
fn header_of(line: &str) -> Option<(Vec<String>, bool)> {
    let line = line.trim();
    if let Some(inner) = line.strip_prefix("[[") {
        let inner = inner.split("]]").next()?;
        return Some((split_key(inner), true));
    }
    let inner = line.strip_prefix('[')?;
    // The closing bracket outside quotes; a comment may follow.
    let end = inner.find(']')?;
    Some((split_key(&inner[..end]), false))
}

/// Walks the lines of a TOML `text`, calling `each(line number, byte offset, line, path)` with
/// the path of every header line (its table, lists of tables with their index) and of every key
/// line (its table's path and the key's parts), and `at_value`: the byte offset of the `=`.
fn walk(text: &str, mut each: impl FnMut(usize, usize, &str, &[Seg], Option<usize>) -> bool) {
    let mut table: Vec<Seg> = Vec::new();
    let mut counts: Vec<(Vec<String>, usize)> = Vec::new();
    let mut offset = 0;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            if let Some((keys, list)) = header_of(trimmed) {
                table = keys.iter().cloned().map(Seg::Key).collect();
                if list {
                    let n = match counts.iter_mut().find(|(k, _)| *k == keys) {
                        Some((_, n)) => {
                            *n += 1;
                            *n
                        }
                        None => {
                            counts.push((keys, 0));
                            0
                        }
                    };
                    table.push(Seg::Index(n));
                }
                if each(i + 1, offset, line, &table, None) {
                    return;
                }
            }
        } else if !trimmed.starts_with('#') {
            if let Some(eq) = line.find('=') {
                let mut path = table.clone();
                path.extend(split_key(&line[..eq]).into_iter().map(Seg::Key));
                if each(i + 1, offset, line, &path, Some(eq)) {
                    return;
                }
            } else if each(i + 1, offset, line, &table, None) {
                return;
            }
        }
        offset += line.len();
    }
}

/// The path of what stands at byte `pos` of `written` (a section as `toml` writes it): a header
/// names its table (or, at one of its keys, the table that key names); a key line its key from the
/// `=` on, else the table it is in.
fn written_path(written: &str, pos: usize) -> Vec<Seg> {
    let mut found = Vec::new();
    let mut table = Vec::new();
    walk(written, |_, offset, line, path, eq| {
        let header = line.trim_start().starts_with('[');
        if eq.is_none() || header {
            table = path.to_vec();
        }
        if pos < offset + line.len() {
            found = match eq {
                Some(eq) if pos >= offset + eq => path.to_vec(),
                _ => table.clone(),
            };
            // `[[mla.rl.rewards]]` at `rl`: the table `mla.rl`.
            let before = line.get(..pos.saturating_sub(offset)).unwrap_or("").trim_start().trim_start_matches('[');
            if header && !before.is_empty() {
                let k = split_key(before).len();
                let keys = found.iter().filter(|s| matches!(s, Seg::Key(_))).count();
                if k < keys {
                    found = found.iter().filter(|s| matches!(s, Seg::Key(_))).take(k).cloned().collect();
                }
            }
            return true;
        }
        false
    });
    found
}

/// The line of `text` that names the longest start of `path` (its key, else the table or list
/// element it is in, else the key that holds that inline).
pub(super) fn locate(text: &str, path: &[Seg]) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    walk(text, |line, _, _, here, _| {
        let matched = here.len() <= path.len() && path.starts_with(here) && !here.is_empty();
        if matched && best.is_none_or(|(n, _)| here.len() > n) {
            best = Some((here.len(), line));
        }
        false
    });
    best.map(|(_, line)| line)
}

/// The value at `path` of `table`.
fn value_at<'t>(table: &'t toml::Table, path: &[Seg]) -> Option<&'t toml::Value> {
    let (Seg::Key(first), rest) = path.split_first()? else { return None };
    let mut v = table.get(first)?;
    for seg in rest {
        v = match (seg, v) {
            (Seg::Key(k), toml::Value::Table(t)) => t.get(k)?,
            (Seg::Index(i), toml::Value::Array(a)) => a.get(*i)?,
            _ => return None,
        };
    }
    Some(v)
}

/// The table holding the last key of `path`, and that key.
fn parent_of<'t>(table: &'t mut toml::Table, path: &[Seg]) -> Option<(&'t mut toml::Table, String)> {
    let (Seg::Key(last), init) = path.split_last()? else { return None };
    let mut t = table;
    let mut segs = init.iter().peekable();
    while let Some(seg) = segs.next() {
        let Seg::Key(k) = seg else { return None };
        let v = t.get_mut(k)?;
        let v = match (segs.peek(), v) {
            (Some(Seg::Index(i)), toml::Value::Array(a)) => {
                let i = *i;
                segs.next();
                a.get_mut(i)?
            }
            (_, v) => v,
        };
        t = v.as_table_mut()?;
    }
    Some((t, last.clone()))
}

/// Takes the value at `path` out of `table`; false if there is none.
fn remove_at(table: &mut toml::Table, path: &[Seg]) -> bool {
    parent_of(table, path).is_some_and(|(t, k)| t.remove(&k).is_some())
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
    fn paths_of_written_sections_and_of_the_file() {
        let written = "a = 1\n\n[mla]\nv_dim = true\n\n[[rewards]]\nkind = \"x\"\n\n[[rewards]]\nlimit = \"x\"\n";
        let at = |needle: &str| written_path(written, written.find(needle).unwrap());
        let k = |s: &str| Seg::Key(s.into());
        assert_eq!(at("true"), [k("mla"), k("v_dim")]);
        assert_eq!(at("[mla]"), [k("mla")]);
        let headers = "[[mla.rl.rewards]]\nx = 1\n";
        assert_eq!(written_path(headers, 6), [k("mla"), k("rl")], "at `rl` of the header");
        assert_eq!(written_path(headers, 0), [k("mla"), k("rl"), k("rewards"), Seg::Index(0)]);
        assert_eq!(at("v_dim"), [k("mla")], "a key's name is in its table");
        assert_eq!(at("\"x\"\n\n"), [k("rewards"), Seg::Index(0), k("kind")]);
        assert_eq!(at("limit"), [k("rewards"), Seg::Index(1)]);
        assert_eq!(written_path(written, written.rfind("\"x\"").unwrap()), [k("rewards"), Seg::Index(1), k("limit")]);
        let text = "[rl]\nx = 1\n[[rl.rewards]]\nkind = \"a\"\n[[rl.rewards]] # second\nkind = \"b\"\n\
                    [model]\nmla = { v_dim = true }\n\"a.b\" = 2\n";
        let path = |p: &[Seg]| {
            let mut full = vec![k("rl")];
            full.extend(p.iter().cloned());
            locate(text, &full)
        };
        assert_eq!(path(&[k("rewards"), Seg::Index(1), k("kind")]), Some(6));
        assert_eq!(path(&[k("rewards"), Seg::Index(1), k("limit")]), Some(5));
        assert_eq!(path(&[k("rewards"), Seg::Index(0)]), Some(3));
        assert_eq!(path(&[k("zz")]), Some(1));
        assert_eq!(locate(text, &[k("model"), k("mla"), k("v_dim")]), Some(8));
        assert_eq!(locate(text, &[k("model"), k("a.b")]), Some(9));
        assert_eq!(split_key(" \"a.b\" . c"), ["a.b", "c"]);
        assert_eq!(render(&[k("rewards"), Seg::Index(1), k("limit")]), "rewards[1].limit");
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
