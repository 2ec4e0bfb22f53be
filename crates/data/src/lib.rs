//! From text to batches: dataset manifests and downloads, tokenizers, token shards, and windows.
//!
//! Pipeline: `manifest`/`fetch` find the text -> `tokenizer` -> `prepare` writes `shards` ->
//! `loader` draws windows and batches them.

mod detokenize;
pub mod error;
pub mod fetch;
pub mod finetune;
pub mod loader;
pub mod manifest;
pub mod preference;
pub mod prepare;
pub mod prompts;
pub mod shards;
pub mod stream;
pub mod tokenizer;

pub use error::DataError;

/// What a path of type `kind` is when it is neither a regular file nor a folder ("a FIFO (named
/// pipe)", "a socket", "a device", "a special file"); `None` for a file or a folder. Such a path is
/// never opened to read it: a FIFO blocks until a writer comes, and cannot be read twice.
pub fn special_file(kind: std::fs::FileType) -> Option<&'static str> {
    if kind.is_file() || kind.is_dir() {
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if kind.is_socket() {
            return Some("a socket");
        }
        if kind.is_block_device() || kind.is_char_device() {
            return Some("a device");
        }
    }
    Some("a special file")
}
pub use detokenize::DecodeStream;
pub use loader::{Examples, LmBatch, LmBatcher, TokenWindows, Window, WindowSampler};
pub use manifest::Manifest;
pub use prepare::{prepare, Prepared};
pub use shards::TokenShard;
pub use tokenizer::{Tokenizer, TokenizerSpec};

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` so that a reader sees the old file or the whole new one, never a part,
/// even after a power loss: a temporary file in the same folder, written and fsynced, renamed over
/// `path`, then the folder fsynced. Without the file's fsync the rename can reach the disk before
/// the data (an empty or partial file after a crash); without the folder's, the rename itself can be
/// lost, so a caller that goes on to delete what the new file replaces could be left with neither.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(DataError::io(path))?;
    sync_dir(dir).map_err(DataError::io(dir))
}

/// Flushes a folder's entries (files created, renamed or removed in it) to disk. Renames are only
/// durable once their folder is synced. A no-op where folders cannot be opened (Windows), whose
/// file systems journal renames themselves.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}
