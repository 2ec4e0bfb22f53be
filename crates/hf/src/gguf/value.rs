//! GGUF metadata values ([`Value`]) and their reading by type ([`Meta`]): a value of the wrong
//! type or a NaN is an error that names the key, never a default.

use std::collections::BTreeMap;
use std::path::Path;

use super::GgufError;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The type's name in messages: `u32`, `f32`, `string`, `array`, ...
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// The type, and the value too when it is a short scalar: `i32 (-1)`, `string`.
    pub(super) fn describe(&self) -> String {
        let value = match *self {
            Value::Bool(b) => Some(b.to_string()),
            Value::I8(x) => Some(x.to_string()),
            Value::I16(x) => Some(x.to_string()),
            Value::I32(x) => Some(x.to_string()),
            Value::I64(x) => Some(x.to_string()),
            Value::String(_) | Value::Array(_) => None,
            ref v => v.as_f64().map(|x| x.to_string()),
        };
        match value {
            Some(value) => format!("{} ({value})", self.type_name()),
            None => self.type_name().to_string(),
        }
    }

    pub(super) fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// An unsigned integer of any width (negative values are not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A GGUF file's metadata read by type: a value of another type than the key's is an error that
/// names both types, never taken for a missing value; a float must be finite.
#[derive(Clone, Copy)]
pub struct Meta<'a> {
    /// The file, for messages.
    pub path: &'a Path,
    pub map: &'a BTreeMap<String, Value>,
}

impl<'a> Meta<'a> {
    /// `key`'s value as `read` takes it, `None` when absent; a value `read` refuses is
    /// [`GgufError::WrongType`] (`expected` says what it takes).
    fn typed<T>(
        &self,
        key: &str,
        expected: &'static str,
        read: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        let Some(v) = self.map.get(key) else { return Ok(None) };
        let wrong = || GgufError::WrongType { path: self.path.into(), key: key.into(), found: v.describe(), expected };
        read(v).map(Some).ok_or_else(wrong)
    }

    /// A string.
    pub fn str(&self, key: &str) -> Result<Option<&'a str>, GgufError> {
        self.typed(key, "string", Value::as_str)
    }

    /// An unsigned integer of any width.
    pub fn u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.typed(key, "an unsigned integer", Value::as_u64)
    }

    /// A boolean.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.typed(key, "a boolean", |v| match *v {
            Value::Bool(b) => Some(b),
            _ => None,
        })
    }

    /// A finite number (an f32 as its shortest decimal: `decimal`); NaN or infinity is
    /// [`GgufError::NonFinite`].
    pub fn float(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.typed(key, "a number", decimal)? {
            Some(value) if !value.is_finite() => {
                Err(GgufError::NonFinite { path: self.path.into(), key: key.into(), value })
            }
            x => Ok(x),
        }
    }
}

/// A metadata number as f64; an f32 (as llama.cpp's converter writes epsilons and RoPE bases) as the
/// shortest decimal that is that f32, so that `1e-5` written as f32 reads back as `1e-5`, not
/// `9.99999974e-6` (the same f32, which is what the kernels compute with).
fn decimal(v: &Value) -> Option<f64> {
    match *v {
        Value::F32(x) if x.is_finite() => format!("{x}").parse().ok(),
        ref v => v.as_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_metadata_names_the_type_found_and_refuses_non_finite_floats() {
        let map: BTreeMap<String, Value> = [
            ("name".to_string(), Value::U32(7)),
            ("negative".to_string(), Value::I32(-1)),
            ("base".to_string(), Value::F32(f32::NAN)),
            ("eps".to_string(), Value::F64(f64::INFINITY)),
            ("text".to_string(), Value::String("1e-5".into())),
            ("ok".to_string(), Value::F32(1e-5)),
        ]
        .into_iter()
        .collect();
        let meta = Meta { path: Path::new("t.gguf"), map: &map };
        fn err<T>(r: Result<T, GgufError>) -> String {
            r.err().expect("an error").to_string()
        }
        assert_eq!(err(meta.str("name")), "t.gguf: metadata `name` has type u32 (7), expected string");
        assert!(err(meta.u64("negative")).contains("has type i32 (-1), expected an unsigned integer"));
        assert!(err(meta.float("text")).contains("`text` has type string, expected a number"));
        assert_eq!(err(meta.float("base")), "t.gguf: metadata `base` is NaN, not a finite number");
        assert!(err(meta.float("eps")).contains("`eps` is inf"));
        assert_eq!(meta.float("ok").unwrap(), Some(1e-5));
        assert_eq!(meta.str("absent").unwrap(), None);
    }
}
