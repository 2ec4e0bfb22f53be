//! GGUF writing: a file's bytes from its metadata and tensors, as [`super::GgufFile`] reads them
//! (version 3, alignment 32, each tensor's data padded to the alignment).

use super::{GgmlType, Value, DEFAULT_ALIGNMENT, MAGIC};

/// A tensor to write: its name, row-major shape, type and encoded bytes.
pub struct TensorOut {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: GgmlType,
    pub data: Vec<u8>,
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            let ty = items.first().map_or(4, Value::type_id);
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
    }
}

/// Encodes a GGUF v3 file (alignment 32) of `metadata` and `tensors`.
pub fn encode(metadata: &[(String, Value)], tensors: &[TensorOut]) -> Vec<u8> {
    let align = DEFAULT_ALIGNMENT as usize;
    let pad = |n: usize| (align - n % align) % align;
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_string(&mut out, k);
        out.extend_from_slice(&v.type_id().to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0usize;
    for t in tensors {
        put_string(&mut out, &t.name);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        t.shape.iter().rev().for_each(|&d| out.extend_from_slice(&(d as u64).to_le_bytes()));
        out.extend_from_slice(&t.kind.id().to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.data.len() + pad(t.data.len());
    }
    out.resize(out.len() + pad(out.len()), 0);
    for t in tensors {
        out.extend_from_slice(&t.data);
        out.resize(out.len() + pad(t.data.len()), 0);
    }
    out
}
