//! ember's dequantization of every ggml type it reads against the `gguf` Python package's (llama.cpp's
//! reference reader), on random blocks recorded by tests/fixtures/make_gguf_fixtures.py.

use std::collections::BTreeSet;

use ember_hf::gguf::quant::{dequantize, GgmlType};

#[test]
fn every_type_dequantizes_as_the_reference_reader_does() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/quants.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    let names: BTreeSet<&str> = cases.iter().map(|c| c["type"].as_str().unwrap()).collect();
    let reads: BTreeSet<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
    assert_eq!((names, cases.len()), (reads, GgmlType::ALL.len()), "one case per type ember reads");
    for case in cases {
        let name = case["type"].as_str().unwrap();
        let ty = GgmlType::from_id(case["id"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(ty.name().replace('_', ""), name.replace('_', ""), "type ids");
        let hex = case["bytes"].as_str().unwrap();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let want: Vec<f32> = case["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let mut got = vec![0f32; want.len()];
        assert_eq!(ty.bytes_for(want.len() as u64), Some(bytes.len() as u64), "{name}: block size");
        dequantize(ty, &bytes, &mut got);
        // ember multiplies in the reference's order (scale products first, no fused multiply-add),
        // so every value agrees to the bit.
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name} value {i}: ember {g}, gguf {w}");
        }
    }
}
