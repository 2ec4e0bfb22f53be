//! The prepared char-level shards of tinyshakespeare hold exactly nanoGPT's token ids.
//!
//! Needs `input.txt`: in `datasets/tinyshakespeare/` or `$EMBER_DATA_DIR/tinyshakespeare/` (`.ci/run`
//! copies it into place).

use std::path::PathBuf;

use ember_data::fetch::{locate, Locations};
use ember_data::prepare::{prepare, split_text};
use ember_data::{Manifest, TokenizerSpec};
use sha2::{Digest, Sha256};

fn input_txt() -> PathBuf {
    let loc = Locations {
        repo_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../datasets"),
        data_dir: std::env::var_os("EMBER_DATA_DIR").map(PathBuf::from),
        cache_dir: std::env::temp_dir().join("ember-test-cache"),
    };
    let m = Manifest::built_in("tinyshakespeare").unwrap();
    // Found, or downloaded (sha256 checked); offline the error says where to put the file.
    locate(&m, &loc).unwrap_or_else(|e| panic!("{e}"))
}

fn sha256_u16(ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn char_shards_match_nanogpt() {
    let dir = tempfile::tempdir().unwrap();
    let p = prepare(&input_txt(), &TokenizerSpec::Char, 0.1, dir.path()).unwrap();
    // Reference values: ../shared/datasets/tinyshakespeare/SOURCE.md (nanoGPT's prepare.py output).
    assert_eq!(p.meta.vocab_size, 65);
    assert_eq!(p.train.tokens.len(), 1_003_854);
    assert_eq!(p.val.tokens.len(), 111_540);
    assert_eq!(&p.train.tokens[..16], &[18, 47, 56, 57, 58, 1, 15, 47, 58, 47, 64, 43, 52, 10, 0, 14]);
    assert_eq!(sha256_u16(&p.train.tokens), "6ec305602a99ac2802745a134e1f5e33e2231b4855525b00b9aebb730ac2626f");
    assert_eq!(sha256_u16(&p.val.tokens), "d37d30cc0c8327c270d493299c3dca54135f6d5f1c9ef60cda78076e311204b1");
    // The file on disk, header dropped, is nanoGPT's train.bin byte for byte.
    let on_disk = std::fs::read(dir.path().join("train.bin")).unwrap();
    let body = &on_disk[ember_data::shards::HEADER_LEN..];
    assert_eq!(body.len(), 2_007_708);
    assert_eq!(
        Sha256::digest(body).iter().map(|b| format!("{b:02x}")).collect::<String>(),
        "6ec305602a99ac2802745a134e1f5e33e2231b4855525b00b9aebb730ac2626f"
    );
}

#[test]
fn char_table_lookup_equals_the_tokenizers_pipeline_on_the_corpus() {
    let text = std::fs::read_to_string(input_txt()).unwrap();
    let tok = ember_data::Tokenizer::train_char(&text);
    let (_, val) = split_text(&text, 0.1);
    assert_eq!(tok.encode(val).unwrap(), tok.encode_reference(val).unwrap());
}
