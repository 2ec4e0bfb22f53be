//! Grammars driven by random draws over real vocabularies: SmolLM2's (read from its GGUF, as
//! `ember` reads it), and GPT-2's, Llama 2's (SentencePiece with byte fallback), Llama 3's and
//! Qwen3's tokenizer.json from the shared assets. Each walk draws, with a seeded generator, among
//! the tokens the mask allows (leaning toward closing tokens so that free strings end) until the
//! constraint says it is finished; the decoded text must then parse and be valid.

use std::path::PathBuf;

use ember_data::tokenizer::Tokenizer;
use ember_generate::constraint::{allows, Constraint};
use ember_grammar::{Grammars, Spec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value as Json};

#[path = "../../../tests/assets.rs"]
mod assets;
use assets::{assets, root};

const SMOLLM2_GGUF: &str = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
const TOKENIZER_FILES: [&str; 4] =
    ["gpt2_tokenizer.json", "llama2_tokenizer.json", "llama3_tokenizer.json", "qwen3_tokenizer.json"];
const SCHEMAS: [&str; 3] = ["person.json", "order.json", "event.json"];
/// Draws a walk may take before it counts as stuck.
const MAX_DRAWS: usize = 600;

/// SmolLM2's tokenizer, rebuilt from its GGUF's metadata.
fn smollm2() -> Tokenizer {
    let file = ember_hf::gguf::GgufFile::open(&assets().join(SMOLLM2_GGUF)).expect("SmolLM2's GGUF");
    let (json, _) = ember_hf::gguf::tokenizer::from_gguf(&file).expect("its tokenizer");
    Tokenizer::from_json(&json).expect("a tokenizer")
}

/// Every vocabulary under test, named.
fn tokenizers() -> Vec<(String, Tokenizer)> {
    let mut all = vec![("smollm2".to_string(), smollm2())];
    for name in TOKENIZER_FILES {
        let tok = Tokenizer::from_file(&assets().join("tokenizers").join(name)).expect(name);
        all.push((name.to_string(), tok));
    }
    all
}

fn schema(name: &str) -> Json {
    let path: PathBuf = root().join("experiments/structured-output").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).expect("schema file")).expect("schema JSON")
}

/// How much a walk leans toward a token: 2 if its text closes something (`}`, `]`), 1 if it has a
/// quote or a comma (ends a string or a number: digits alone could go on for ever), 0 otherwise.
fn closing_rank(tok: &Tokenizer, vocab: usize) -> Vec<u8> {
    (0..vocab as u32)
        .map(|id| {
            let text = tok.decode(&[id]).unwrap_or_default();
            if text.contains('}') || text.contains(']') {
                2
            } else {
                u8::from(text.contains('"') || text.contains(','))
            }
        })
        .collect()
}

/// Draws until the constraint is finished or allows an end id (taken at once): the generated ids,
/// or those drawn so far if there is no end in `MAX_DRAWS` draws.
fn walk(c: &mut dyn Constraint, end_ids: &[u32], rank: &[u8], vocab: usize, seed: u64) -> Result<Vec<u32>, Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = Vec::new();
    while !c.finished() {
        if ids.len() == MAX_DRAWS {
            return Err(ids);
        }
        let mask = c.mask().expect("a mask");
        let allowed: Vec<u32> = (0..vocab as u32).filter(|&id| allows(mask, id as usize)).collect();
        assert!(!allowed.is_empty(), "an empty mask after {ids:?}");
        if allowed.iter().any(|id| end_ids.contains(id)) {
            assert!(end_ids.iter().all(|id| allowed.contains(id)), "every end id is allowed where one is");
            break;
        }
        let lean = rng.random_range(0..3u8);
        let best = allowed.iter().map(|&id| rank[id as usize]).max().unwrap_or(0).min(lean);
        let pool: Vec<u32> = allowed.into_iter().filter(|&id| rank[id as usize] >= best).collect();
        let id = pool[rng.random_range(0..pool.len())];
        c.commit(id).expect("an allowed token commits");
        ids.push(id);
    }
    Ok(ids)
}

/// A small JSON Schema check, enough for the schemas here: type, enum, properties, required,
/// additionalProperties: false, items, min/maxItems, maxLength, minimum/maximum, the one pattern,
/// local `$ref`s. Errors name the path.
fn validate(value: &Json, schema: &Json, root: &Json, path: &str) -> Result<(), String> {
    if let Some(r) = schema["$ref"].as_str() {
        let target = r.trim_start_matches("#/").split('/').fold(root, |s, key| &s[key]);
        return validate(value, target, root, path);
    }
    if let Some(options) = schema["enum"].as_array() {
        if !options.contains(value) {
            return Err(format!("{path}: {value} is not one of {options:?}"));
        }
    }
    if !type_matches(value, &schema["type"]) {
        return Err(format!("{path}: {value} is not of type {}", schema["type"]));
    }
    match value {
        Json::Object(map) => validate_object(map, schema, root, path),
        Json::Array(items) => validate_array(items, schema, root, path),
        Json::String(s) => validate_string(s, schema, path),
        Json::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            let low = schema["minimum"].as_f64().is_some_and(|m| x < m);
            let high = schema["maximum"].as_f64().is_some_and(|m| x > m);
            if low || high {
                return Err(format!("{path}: {x} is out of range"));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn type_matches(value: &Json, ty: &Json) -> bool {
    match ty {
        Json::String(t) => match t.as_str() {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            // `-0` parses as a float, and is the integer 0.
            "integer" => value.as_f64().is_some_and(|x| x.fract() == 0.0),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            _ => false,
        },
        Json::Array(types) => types.iter().any(|t| type_matches(value, t)),
        _ => true,
    }
}

fn validate_object(map: &serde_json::Map<String, Json>, schema: &Json, root: &Json, path: &str) -> Result<(), String> {
    for key in schema["required"].as_array().into_iter().flatten() {
        if !map.contains_key(key.as_str().unwrap_or_default()) {
            return Err(format!("{path}: required key {key} is missing"));
        }
    }
    for (key, v) in map {
        match schema["properties"].get(key) {
            Some(sub) => validate(v, sub, root, &format!("{path}.{key}"))?,
            None if schema["additionalProperties"] == false => {
                return Err(format!("{path}: key {key:?} is not allowed"))
            }
            None => {}
        }
    }
    Ok(())
}

fn validate_array(items: &[Json], schema: &Json, root: &Json, path: &str) -> Result<(), String> {
    let n = items.len() as u64;
    if schema["minItems"].as_u64().is_some_and(|m| n < m) || schema["maxItems"].as_u64().is_some_and(|m| n > m) {
        return Err(format!("{path}: {n} items"));
    }
    items.iter().enumerate().try_for_each(|(i, v)| validate(v, &schema["items"], root, &format!("{path}[{i}]")))
}

fn validate_string(s: &str, schema: &Json, path: &str) -> Result<(), String> {
    if schema["maxLength"].as_u64().is_some_and(|m| s.chars().count() as u64 > m) {
        return Err(format!("{path}: {s:?} is too long"));
    }
    if schema["pattern"] == "^[0-9]{5}$" && !(s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit())) {
        return Err(format!("{path}: {s:?} does not match the pattern"));
    }
    Ok(())
}

/// Walks `spec` `walks` times over `tok` and hands each decoded text to `check`.
fn walks(name: &str, tok: &Tokenizer, spec: &Spec, walks: u64, check: impl Fn(&str) -> Result<(), String>) {
    let vocab = tok.vocab_size();
    let end_ids = tok.end_ids();
    let grammars = Grammars::new(tok, &end_ids, vocab).expect("grammars");
    let rank = closing_rank(tok, vocab);
    for seed in 0..walks {
        let mut c = grammars.constraint(spec).expect("a constraint");
        let ids = walk(c.as_mut(), &end_ids, &rank, vocab, seed).unwrap_or_else(|ids| {
            panic!("{name}, {spec:?}, seed {seed}: no end after {MAX_DRAWS} draws: {:?}", tok.decode(&ids))
        });
        let text = tok.decode(&ids).expect("decodes");
        if let Err(e) = check(&text) {
            panic!("{name}, {spec:?}, seed {seed}: {e}\n{text}");
        }
    }
}

fn parses_and_validates(schema: &Json) -> impl Fn(&str) -> Result<(), String> + '_ {
    move |text| {
        let value: Json = serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
        validate(&value, schema, schema, "$")
    }
}

#[test]
fn schemas_hold_over_every_vocabulary() {
    for (name, tok) in tokenizers() {
        for file in SCHEMAS {
            let schema = schema(file);
            for strict in [true, false] {
                let spec = Spec::JsonSchema { schema: schema.clone(), strict };
                walks(&name, &tok, &spec, 6, parses_and_validates(&schema));
            }
        }
    }
}

#[test]
fn json_objects_are_compact_objects() {
    let tok = smollm2();
    let object = json!({"type": "object"});
    walks("smollm2", &tok, &Spec::JsonObject, 12, |text| {
        parses_and_validates(&object)(text)?;
        // No free whitespace: a space only inside strings or right after `,` / `:`.
        let value: Json = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let python_layout = serde_json::to_string(&value).map_err(|e| e.to_string())?;
        let spaces = text.matches(' ').count() - python_layout.matches(' ').count();
        let separators = text.matches(", ").count() + text.matches(": ").count();
        (spaces <= separators && !text.contains('\n')).then_some(()).ok_or_else(|| "free whitespace".to_string())
    });
}

#[test]
fn lark_and_regex_grammars_hold() {
    let lark = r#"
        start: "call " name "(" arg ("," arg)* ")"
        name: /[a-z_]{1,8}/
        arg: /[0-9]{1,3}/ | "true" | "false"
    "#;
    let shape = |text: &str| {
        let inner = text.strip_prefix("call ").and_then(|t| t.strip_suffix(')')).ok_or("no call(...)")?;
        let (name, args) = inner.split_once('(').ok_or("no (")?;
        let name_ok = (1..=8).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
        let args_ok = args.split(',').all(|a| a == "true" || a == "false" || a.parse::<u16>().is_ok_and(|n| n < 1000));
        (name_ok && args_ok).then_some(()).ok_or(format!("bad call {text:?}"))
    };
    let date = |text: &str| {
        let parts: Vec<&str> = text.split('-').collect();
        let ok = parts.len() == 3
            && [4, 2, 2].iter().zip(&parts).all(|(n, p)| p.len() == *n && p.bytes().all(|b| b.is_ascii_digit()));
        ok.then_some(()).ok_or(format!("not a date: {text:?}"))
    };
    for (name, tok) in tokenizers() {
        walks(&name, &tok, &Spec::Lark(lark.into()), 4, shape);
        walks(&name, &tok, &Spec::Regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}".into()), 4, date);
    }
}

#[test]
fn bad_specs_are_named() {
    let tok = smollm2();
    let grammars = Grammars::new(&tok, &tok.end_ids(), tok.vocab_size()).unwrap();
    // A keyword of JSON Schema that llguidance does not implement (unknown words are annotations).
    let unknown = json!({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": true}}});
    let e = grammars.check(&Spec::JsonSchema { schema: unknown.clone(), strict: true }).unwrap_err().to_string();
    assert!(e.contains("JSON schema") && e.contains("uniqueItems"), "{e}");
    // Not strict: the keyword is left out, the rest holds.
    grammars.check(&Spec::JsonSchema { schema: unknown, strict: false }).unwrap();
    let bad_type = json!({"type": "strnig"});
    let e = grammars.check(&Spec::JsonSchema { schema: bad_type, strict: true }).unwrap_err().to_string();
    assert!(e.contains("strnig"), "{e}");
    let e = grammars.check(&Spec::JsonSchema { schema: json!([1]), strict: true }).unwrap_err().to_string();
    assert!(e.contains("an array"), "{e}");
    let e = grammars.check(&Spec::Lark("start: (".into())).unwrap_err().to_string();
    assert!(e.starts_with("invalid Lark grammar"), "{e}");
    let e = grammars.check(&Spec::Regex("a(".into())).unwrap_err().to_string();
    assert!(e.starts_with("invalid regex"), "{e}");
}
