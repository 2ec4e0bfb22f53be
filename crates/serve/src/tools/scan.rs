//! The JSON of a call block as far as it is written ([`probe`]), and once whole ([`parse_calls`]).

use serde_json::{Map, Value};

/// What is known of one call while its JSON is being written: offsets are within the block's JSON.
#[derive(Debug, Default, Clone)]
pub(super) struct Partial {
    pub(super) name: Option<String>,
    /// Where its arguments object starts, and ends once closed.
    pub(super) arguments: Option<(usize, Option<usize>)>,
}

#[derive(Debug)]
pub(super) enum Probe {
    /// Not yet a whole JSON value.
    Pending(Vec<Partial>),
    /// A whole value ending at this offset.
    Complete(usize, Vec<Partial>),
    /// Not a JSON object or list.
    Malformed,
}

/// Scans the JSON of a block (one call object, or a list of them) as far as it is written: where
/// it ends, and each call's name and where its arguments (the key `arguments_key`, or
/// `arguments`) are. Only the structure is followed; [`parse_calls`] checks the JSON once whole.
pub(super) fn probe(json: &str, arguments_key: &str) -> Probe {
    let (mut depth, mut call_depth) = (0usize, 0usize);
    let (mut in_string, mut escaped, mut string_start) = (false, false, 0);
    let mut calls: Vec<Partial> = Vec::new();
    // At the calls' depth: whether the next string is a key, the last key, and whether a value
    // (of that key) is next.
    let (mut expect_key, mut key, mut value_next) = (false, String::new(), false);
    for (i, b) in json.bytes().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
                if depth == call_depth && expect_key {
                    key = serde_json::from_str(&json[string_start..=i]).unwrap_or_default();
                    expect_key = false;
                } else if depth == call_depth && key == "name" {
                    if let Some(call) = calls.last_mut() {
                        call.name = serde_json::from_str(&json[string_start..=i]).ok();
                    }
                }
            }
            continue;
        }
        if b.is_ascii_whitespace() {
            continue;
        }
        let value_starts = std::mem::take(&mut value_next);
        match b {
            b'{' | b'[' => {
                if depth == 0 {
                    call_depth = if b == b'{' { 1 } else { 2 };
                }
                let is_arguments = key == arguments_key || key == "arguments";
                if value_starts && b == b'{' && is_arguments {
                    if let Some(call) = calls.last_mut() {
                        call.arguments = Some((i, None));
                    }
                }
                depth += 1;
                if depth == call_depth && b == b'{' {
                    calls.push(Partial::default());
                    (expect_key, key) = (true, String::new());
                }
            }
            _ if depth == 0 => return Probe::Malformed,
            b'}' | b']' => {
                depth -= 1;
                if depth == call_depth {
                    if let Some(Partial { arguments: Some((_, end @ None)), .. }) = calls.last_mut() {
                        *end = Some(i + 1);
                    }
                }
                if depth == 0 {
                    return Probe::Complete(i + 1, calls);
                }
            }
            b'"' => (in_string, string_start) = (true, i),
            b':' if depth == call_depth => value_next = true,
            b',' if depth == call_depth => (expect_key, key) = (true, String::new()),
            _ => {}
        }
    }
    Probe::Pending(calls)
}

/// The calls in a block's whole JSON: a call object or a non-empty list of them, each with a
/// `name` and its arguments (`arguments_key` or `arguments`) an object, a string of JSON holding
/// one, or left out (`{}`). `None` when it is anything else.
pub(super) fn parse_calls(json: &str, arguments_key: &str) -> Option<Vec<(String, Value)>> {
    let value: Value = serde_json::from_str(json).ok()?;
    let objects = match value {
        Value::Object(o) => vec![o],
        Value::Array(items) if !items.is_empty() => {
            items.into_iter().map(|v| if let Value::Object(o) = v { Some(o) } else { None }).collect::<Option<_>>()?
        }
        _ => return None,
    };
    objects.into_iter().map(|o| call_of(o, arguments_key)).collect()
}

fn call_of(mut o: Map<String, Value>, arguments_key: &str) -> Option<(String, Value)> {
    let name = match o.remove("name") {
        Some(Value::String(n)) if !n.is_empty() => n,
        _ => return None,
    };
    let arguments = match o.remove(arguments_key).or_else(|| o.remove("arguments")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(v @ Value::Object(_)) => v,
        Some(Value::String(s)) => match serde_json::from_str(&s).ok()? {
            v @ Value::Object(_) => v,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some((name, arguments))
}
