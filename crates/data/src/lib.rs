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

/// Opens `path` to read it, refusing what is not a regular file (or a link to one) before a byte
/// is read: a folder, a FIFO, a socket, a device. Every file a user names goes through it (configs,
/// data, tokenizers, model files): a FIFO would block until a writer came, a device might never
/// end. The error says what the path is ("is a FIFO (named pipe), not a regular file"); callers
/// add the path. The open itself does not block either (a path swapped for a FIFO after the check
/// is opened without waiting, and refused by what the opened handle is); on a regular file that
/// flag changes nothing.
pub fn open_file(path: &Path) -> std::io::Result<std::fs::File> {
    let refused = |kind: std::fs::FileType| {
        use std::io::{Error, ErrorKind};
        if kind.is_dir() {
            return Some(Error::new(ErrorKind::IsADirectory, "is a folder, not a file"));
        }
        special_file(kind).map(|what| Error::new(ErrorKind::InvalidInput, format!("is {what}, not a regular file")))
    };
    if let Some(err) = refused(std::fs::metadata(path)?.file_type()) {
        return Err(err);
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path)?;
    match refused(file.metadata()?.file_type()) {
        Some(err) => Err(err),
        None => Ok(file),
    }
}

/// The bytes of the regular file `path` ([`open_file`]'s refusals).
pub fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = open_file(path)?;
    let mut bytes = Vec::with_capacity(file.metadata().map_or(0, |m| m.len() as usize));
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The bytes of a regular file ([`open_file`]'s refusals) mapped read-only where the system maps
/// it, read into memory otherwise (an empty file, a file system that cannot map): for reading a
/// large weights file once, tensor by tensor, letting each tensor's pages go once it is copied
/// ([`FileBytes::release`]), so that the file and what is made from it are not held at once.
///
/// As with llama.cpp's mapping, the file must not be truncated or rewritten while it is mapped:
/// ember writes its checkpoints and exports as a new file renamed over the old one
/// ([`write_atomic`]), which leaves a mapped one intact.
pub struct FileBytes(FileBytesInner);

enum FileBytesInner {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl FileBytes {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = open_file(path)?;
        if file.metadata()?.len() > 0 {
            // SAFETY: read-only; the documentation above keeps the bytes as they were while the
            // mapping lives.
            if let Ok(map) = unsafe { memmap2::Mmap::map(&file) } {
                return Ok(Self(FileBytesInner::Mapped(map)));
            }
        }
        read_file(path).map(|bytes| Self(FileBytesInner::Read(bytes)))
    }

    /// Bytes made in memory, seen as a file's (nothing to release).
    pub fn in_memory(bytes: Vec<u8>) -> Self {
        Self(FileBytesInner::Read(bytes))
    }

    /// Lets the memory pages wholly inside `range` of a mapped file go (they are read from the
    /// file again if touched); nothing for bytes read into memory.
    pub fn release(&self, range: std::ops::Range<usize>) {
        if let FileBytesInner::Mapped(map) = &self.0 {
            let page = 4096;
            let (start, end) = (range.start.div_ceil(page) * page, range.end.min(map.len()) / page * page);
            if end > start {
                // SAFETY: a read-only file mapping: pages let go come back from the file, unchanged.
                let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
            }
        }
    }

    /// [`Self::release`] for the bytes of `inner`, a slice of these bytes.
    pub fn release_bytes(&self, inner: &[u8]) {
        let at = (inner.as_ptr() as usize).saturating_sub(self.as_ptr() as usize);
        self.release(at..at + inner.len());
    }
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            FileBytesInner::Mapped(map) => map,
            FileBytesInner::Read(bytes) => bytes,
        }
    }
}

impl AsRef<[u8]> for FileBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// The text of the regular file `path` ([`open_file`]'s refusals); not UTF-8 is an error.
pub fn read_file_to_string(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    open_file(path)?.read_to_string(&mut text)?;
    Ok(text)
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

/// Writes a new file `out`, which must not exist, so that it is whole or absent: a temporary file
/// beside it written (by `write`) and fsynced, then linked as `out` (a link never replaces a file:
/// one made meanwhile is kept and the write refused with `AlreadyExists`), the folder fsynced. A
/// failed write (a full disk) leaves no file behind, so that running it again does not find one
/// "already there"; the temporary file is removed whatever happens.
pub fn write_new_with(
    out: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let exists = || Error::new(ErrorKind::AlreadyExists, format!("{} already exists", out.display()));
    if out.symlink_metadata().is_ok() {
        return Err(exists());
    }
    let dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        write(&mut file)?;
        file.sync_all()?;
        match std::fs::hard_link(&tmp, out) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(exists()),
            // A file system without links: renamed instead, `out` checked just before.
            Err(_) if out.symlink_metadata().is_ok() => Err(exists()),
            Err(_) => std::fs::rename(&tmp, out),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    written?;
    sync_dir(dir)
}

/// [`write_new_with`] of `bytes`.
pub fn write_new(out: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_new_with(out, |file| file.write_all(bytes))
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
