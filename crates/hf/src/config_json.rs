//! A parsed `config.json` read key by key ([`Reader`]), and the RoPE keys every RoPE family
//! shares: transformers 5's `rope_parameters` (`rope_theta` and `rope_type` inside) and the older
//! top-level `rope_theta` with `rope_scaling`, both read; exports write transformers 5's.

use ember_model::RopeScaling;
use serde_json::{json, Map, Value};

use crate::error::HfError;

/// A parsed `config.json` and the file it came from, for errors.
pub struct Reader<'a> {
    pub(crate) obj: &'a Map<String, Value>,
    source: &'a str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(obj: &'a Map<String, Value>, source: &'a str) -> Self {
        Reader { obj, source }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn usize(&self, key: &'static str) -> Result<usize, HfError> {
        self.opt_usize(key).ok_or(HfError::MissingField { source_name: self.source.into(), field: key })
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Option<usize> {
        self.get(key).and_then(Value::as_u64).map(|v| v as usize)
    }

    pub(crate) fn flag(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub(crate) fn f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub(crate) fn bad(&self, message: String) -> HfError {
        HfError::Config { source_name: self.source.into(), message }
    }

    /// An error unless `key` is absent or `want` (the value ember's family always has).
    pub(crate) fn require(&self, key: &str, want: bool, why: &str) -> Result<(), HfError> {
        match self.flag(key) {
            Some(v) if v != want => Err(self.bad(format!("{key} = {v}: {why}"))),
            _ => Ok(()),
        }
    }
}

/// `rope_theta` and the scaling of a RoPE parameter object (`rope_parameters`, or `None` for an
/// older config.json: its top-level `rope_theta` and `rope_scaling`).
pub(crate) fn read_rope(
    r: &Reader,
    params: Option<&Map<String, Value>>,
    default_theta: f64,
) -> Result<(f64, Option<RopeScaling>), HfError> {
    let theta = params.and_then(|p| p.get("rope_theta")).or_else(|| r.get("rope_theta")).and_then(Value::as_f64);
    let scaling = match params.or_else(|| r.get("rope_scaling").and_then(Value::as_object)) {
        Some(s) => rope_scaling(r, s)?,
        None => None,
    };
    Ok((theta.unwrap_or(default_theta), scaling))
}

fn rope_scaling(r: &Reader, s: &Map<String, Value>) -> Result<Option<RopeScaling>, HfError> {
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f =
        |k: &str| s.get(k).and_then(Value::as_f64).ok_or_else(|| r.bad(format!("rope scaling `{kind}` without `{k}`")));
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: f("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
        }),
        "yarn" => {
            let opt = |k: &str| s.get(k).and_then(Value::as_f64);
            Some(RopeScaling::Yarn {
                factor: f("factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
                beta_fast: opt("beta_fast").unwrap_or(32.0),
                beta_slow: opt("beta_slow").unwrap_or(1.0),
                mscale: opt("mscale"),
                mscale_all_dim: opt("mscale_all_dim"),
                attention_factor: opt("attention_factor"),
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            })
        }
        other => {
            return Err(
                r.bad(format!("rope scaling type `{other}` is not supported (default, linear, llama3, yarn are)"))
            )
        }
    })
}

/// transformers 5's `rope_parameters` object.
pub(crate) fn rope_parameters(theta: f64, scaling: Option<&RopeScaling>) -> Value {
    let mut rope = Map::new();
    rope.insert("rope_theta".into(), json!(theta));
    match scaling {
        None => {
            rope.insert("rope_type".into(), json!("default"));
        }
        Some(&RopeScaling::Linear { factor }) => {
            rope.insert("rope_type".into(), json!("linear"));
            rope.insert("factor".into(), json!(factor));
        }
        Some(&RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            rope.insert("rope_type".into(), json!("llama3"));
            rope.insert("factor".into(), json!(factor));
            rope.insert("low_freq_factor".into(), json!(low_freq_factor));
            rope.insert("high_freq_factor".into(), json!(high_freq_factor));
            rope.insert("original_max_position_embeddings".into(), json!(original_max_position_embeddings));
        }
        Some(&RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            truncate,
        }) => {
            // Integers where they are (transformers writes its defaults 32 and 1 so); `truncate` only
            // when it is not the default.
            let number = |x: f64| if x.fract() == 0.0 && x.abs() < 1e15 { json!(x as i64) } else { json!(x) };
            let entries = [
                ("rope_type", json!("yarn")),
                ("factor", json!(factor)),
                ("original_max_position_embeddings", json!(original_max_position_embeddings)),
                ("beta_fast", number(beta_fast)),
                ("beta_slow", number(beta_slow)),
            ];
            rope.extend(entries.into_iter().map(|(k, v)| (k.to_string(), v)));
            if !truncate {
                rope.insert("truncate".into(), json!(false));
            }
            let optional =
                [("mscale", mscale), ("mscale_all_dim", mscale_all_dim), ("attention_factor", attention_factor)];
            for (key, value) in optional {
                if let Some(v) = value {
                    rope.insert(key.into(), json!(v));
                }
            }
        }
    }
    Value::Object(rope)
}

/// `rope_theta` and the scaling of the top-level `rope_parameters` (or the older keys), 10 000 by
/// default: every RoPE family's but Gemma 3's (whose parameters are per layer type).
pub(crate) fn read_default_rope(r: &Reader) -> Result<(f64, Option<RopeScaling>), HfError> {
    read_rope(r, r.get("rope_parameters").and_then(Value::as_object), 10_000.0)
}
