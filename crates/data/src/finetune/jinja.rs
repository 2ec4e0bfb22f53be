//! The parts of transformers' Jinja environment that minijinja lacks, so that Hugging Face chat
//! templates load and render as `apply_chat_template` renders them: the `{% generation %}` tags,
//! the `strftime_now` function and Python's `str()` as the `string` filter.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// `source` with transformers' `{% generation %}` ... `{% endgeneration %}` (the marks of the
/// assistant's text, for `return_assistant_tokens_mask`; SmolLM3's template has them) as
/// `{% if true %}` ... `{% endif %}`, which minijinja parses and which render the same: the body,
/// with each tag's whitespace control (`{%- generation -%}`) kept.
pub(super) fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match generation_tag(tag) {
            Some((len, replacement)) => {
                out.push_str(&replacement);
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// When `tag` (text starting with `{%`) opens with a generation tag: its length and the tag
/// that stands in for it.
fn generation_tag(tag: &str) -> Option<(usize, String)> {
    let inner = &tag[2..];
    let open = control(inner);
    let body = &inner[open.len()..];
    let word_at = body.len() - body.trim_start().len();
    let word = body[word_at..].split(|c: char| !c.is_ascii_alphanumeric() && c != '_').next()?;
    let stand_in = match word {
        "generation" => "if true",
        "endgeneration" => "endif",
        _ => return None,
    };
    let after = &body[word_at + word.len()..];
    let after_trimmed = after.trim_start();
    let close = if after_trimmed.starts_with("-%}") || after_trimmed.starts_with("+%}") {
        &after_trimmed[..1]
    } else if after_trimmed.starts_with("%}") {
        ""
    } else {
        return None;
    };
    let len = tag.len() - after_trimmed.len() + close.len() + 2;
    Some((len, format!("{{%{open} {stand_in} {close}%}}")))
}

/// The whitespace control (`-` or `+`) at the head of `s`, or nothing.
fn control(s: &str) -> &str {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => &s[..1],
        _ => "",
    }
}

/// transformers' `strftime_now(format)`: the time now, written with Python's `strftime` codes
/// (the date in the UTC calendar; transformers uses the machine's local time). SmolLM3's and
/// Llama 3.2's templates write today's date with it.
pub(super) fn strftime_now(format: String) -> Result<String, Error> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(&format, secs)
}

/// `format` at `secs` seconds after 1970-01-01T00:00:00Z, with the codes templates use: `%d %m %Y
/// %y %B %b %A %a %H %M %S %j %%`. Another code is an error, which names it.
pub(super) fn strftime(format: &str, secs: u64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = secs / 86_400;
    let (year, month, day) = civil_from_days(days);
    let weekday = ((days + 3) % 7) as usize; // 1970-01-01 was a Thursday (Monday = 0).
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs % 86_400 / 3_600, secs % 3_600 / 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month as usize - 1];
        let _ = match chars.next() {
            Some('d') => write!(out, "{day:02}"),
            Some('m') => write!(out, "{month:02}"),
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year % 100),
            Some('B') => write!(out, "{month_name}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('H') => write!(out, "{hour:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('%') => write!(out, "%"),
            other => {
                let code = other.map_or(String::new(), String::from);
                let why = format!("strftime_now: the code `%{code}` is not supported");
                return Err(Error::new(ErrorKind::InvalidOperation, why));
            }
        };
    }
    Ok(out)
}

/// Year, month (1-12) and day (1-31) of the day `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let doe = z - era * 146_097; // [0, 146096]
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365], from March 1
    let mp = (5 * doy + 2) / 153; // [0, 11], March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to `year-month-day` (the inverse of [`civil_from_days`]).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let year = year - u64::from(month <= 2);
    let era = year / 400;
    let yoe = year - era * 400;
    let mp = (month + 9) % 12; // March = 0
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Jinja's `string` filter as transformers runs it: Python's `str()`. A string stays as it is;
/// lists and dicts are written as Python writes them (`{'name': 'f', 'strict': True}`), which is
/// how SmolLM3's template lists its tools (`tool | string`).
pub(super) fn py_string(value: &Value) -> Value {
    match value.kind() {
        ValueKind::String => value.clone(),
        ValueKind::Undefined => Value::from(""),
        _ => {
            let mut out = String::new();
            py_repr(&mut out, value);
            Value::from(out)
        }
    }
}

/// Python's `repr()` of `value`, onto `out`.
fn py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(x) => out.push_str(&py_float(x)),
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::String => py_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key);
                out.push_str(": ");
                py_repr(out, &value.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's `repr()` of a float: the shortest digits that read back, `.0` on a whole number,
/// and an exponent (`1e-05`, `1e+16`) outside `[1e-4, 1e16)`.
fn py_float(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if x == 0.0 || (-4..16).contains(&exponent) {
        let plain = x.to_string();
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

/// Python's `repr()` of a string: in single quotes, or double quotes when it holds a `'` and no
/// `"`; backslashes, that quote and control characters escaped.
fn py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_a_block_that_renders_its_body() {
        assert_eq!(
            without_generation_tags("a{% generation %}b{%- endgeneration -%}c{%generation-%}{%+ endgeneration%}"),
            "a{% if true %}b{%- endif -%}c{% if true -%}{%+ endif %}"
        );
        let others = "{% if add_generation_prompt %}{% generations %}{% set generation = 1 %}{{ '{%' }}";
        assert_eq!(without_generation_tags(others), others);
    }

    #[test]
    fn strftime_writes_pythons_codes() {
        // 2025-01-02T03:04:05Z, a Thursday; 2024-02-29 (a leap day), 2000-12-31.
        assert_eq!(strftime("%d %B %Y", 1_735_787_045).unwrap(), "02 January 2025");
        assert_eq!(strftime("%a %b %d %H:%M:%S %y %j %%", 1_735_787_045).unwrap(), "Thu Jan 02 03:04:05 25 002 %");
        assert_eq!(strftime("%A %Y-%m-%d %j", 1_709_164_800).unwrap(), "Thursday 2024-02-29 060");
        assert_eq!(strftime("%Y-%m-%d %j", 978_220_800).unwrap(), "2000-12-31 366");
        assert!(strftime("%Q", 0).unwrap_err().to_string().contains("`%Q`"));
    }

    #[test]
    fn string_is_pythons_str() {
        // Keys in sorted order: serde_json's maps here may not keep theirs.
        let v = Value::from_serialize(serde_json::json!({
            "e": "a\\b\n\"c\"'", "n": [1, 2.5, 1e-5, 1e16, 3.0], "name": "f", "off": null, "on": true, "q": "it's",
        }));
        assert_eq!(
            py_string(&v).as_str().unwrap(),
            r#"{'e': 'a\\b\n"c"\'', 'n': [1, 2.5, 1e-05, 1e+16, 3.0], 'name': 'f', 'off': None, 'on': True, 'q': "it's"}"#
        );
        assert_eq!(py_string(&Value::from("plain 'text'")).as_str(), Some("plain 'text'"));
        assert_eq!(py_string(&Value::from(false)).as_str(), Some("False"));
    }
}
