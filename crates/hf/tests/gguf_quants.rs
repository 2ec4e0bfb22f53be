//! ember's dequantization of every ggml type it reads against the `gguf` Python package's (llama.cpp's
//! reference reader), on random blocks recorded by tests/fixtures/make_gguf_fixtures.py.

use ember_hf::gguf::quant::{dequantize, GgmlType};

#[test]
fn every_type_dequantizes_as_the_reference_reader_does() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/quants.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8, "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K");
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
        let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * scale, "{name} value {i}: ember {g}, gguf {w}");
        }
    }
}
