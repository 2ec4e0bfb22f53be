//! Paths into a config's TOML: a key of a table or an element of a list at each step
//! (`rl.rewards[1].limit`), found by line in the user's text ([`locate`]) and by byte in a section
//! as `toml` writes it back ([`written_path`]), and the value at a path read, taken out or replaced
//! in a table. `values` reads the sections with them; `keys` places a reward's problems.

/// One step of a path into a section: a key of a table, or an element of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

/// `a.b[1].c`.
pub(super) fn render(path: &[Seg]) -> String {
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
pub(super) fn written_path(written: &str, pos: usize) -> Vec<Seg> {
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
pub(super) fn value_at<'t>(table: &'t toml::Table, path: &[Seg]) -> Option<&'t toml::Value> {
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
pub(super) fn parent_of<'t>(table: &'t mut toml::Table, path: &[Seg]) -> Option<(&'t mut toml::Table, String)> {
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
pub(super) fn remove_at(table: &mut toml::Table, path: &[Seg]) -> bool {
    parent_of(table, path).is_some_and(|(t, k)| t.remove(&k).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
