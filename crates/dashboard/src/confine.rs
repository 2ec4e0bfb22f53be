//! Opening a file only if it lies inside the log directory. A run folder is written by training, but
//! anyone who can write to the log directory can also put a symbolic link there (`config.toml ->
//! ~/.ssh/id_ed25519`); the dashboard must never serve what such a link points at.
//!
//! The check is made on what was actually opened: the path is resolved first, the resolved path is
//! opened without following a final link, and on Linux the open descriptor's own path
//! (`/proc/self/fd/N`) is checked again, so a folder swapped for a link between the two steps is
//! caught too. Only regular files are opened, and without blocking (a named pipe would otherwise
//! hang the reader). A hard link to a file elsewhere cannot be told from a file written in place;
//! making one needs write access to that file's file system, which is outside what a link in the
//! log directory can do.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Why a file under the log directory was not opened.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("{0}: not found")]
    NotFound(PathBuf),
    #[error("{0}: leads outside the log directory")]
    Outside(PathBuf),
    #[error("{0}: not a regular file")]
    NotAFile(PathBuf),
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: io::Error },
}

/// `path` resolved (every link followed), if that stays inside `root`. `root` must be canonical.
pub fn resolve_inside(root: &Path, path: &Path) -> Result<PathBuf, ConfineError> {
    let real = path.canonicalize().map_err(|err| match err.kind() {
        io::ErrorKind::NotFound => ConfineError::NotFound(path.into()),
        _ => ConfineError::Io { path: path.into(), err },
    })?;
    if real.starts_with(root) {
        Ok(real)
    } else {
        Err(ConfineError::Outside(path.into()))
    }
}

/// Opens the regular file at `path` for reading if, links resolved, it lies inside `root` (which
/// must be canonical).
pub fn open_inside(root: &Path, path: &Path) -> Result<File, ConfineError> {
    let real = resolve_inside(root, path)?;
    let io_err = |err: io::Error| match err.kind() {
        io::ErrorKind::NotFound => ConfineError::NotFound(path.into()),
        _ => ConfineError::Io { path: path.into(), err },
    };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // The resolved path has no link left in it; one that appears now is a swap, and refused.
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let file = options.open(&real).map_err(|err| {
        #[cfg(unix)]
        if err.raw_os_error() == Some(libc::ELOOP) {
            return ConfineError::Outside(path.into());
        }
        io_err(err)
    })?;
    if !file.metadata().map_err(io_err)?.is_file() {
        return Err(ConfineError::NotAFile(path.into()));
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // What was opened, whatever happened to the path's folders since it was resolved.
        if let Ok(opened) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
            if !opened.starts_with(root) {
                return Err(ConfineError::Outside(path.into()));
            }
        }
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    fn read(root: &Path, path: &Path) -> Result<String, ConfineError> {
        let mut s = String::new();
        open_inside(root, path)?.read_to_string(&mut s).unwrap();
        Ok(s)
    }

    #[test]
    fn files_inside_open_and_links_out_do_not() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "password = 1\n").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("run/sub")).unwrap();
        std::fs::write(root.join("run/config.toml"), "lr = 1\n").unwrap();
        assert_eq!(read(&root, &root.join("run/config.toml")).unwrap(), "lr = 1\n");

        // A link that stays inside is followed.
        symlink(root.join("run/config.toml"), root.join("run/sub/config.toml")).unwrap();
        assert_eq!(read(&root, &root.join("run/sub/config.toml")).unwrap(), "lr = 1\n");
        symlink("../config.toml", root.join("run/sub/relative.toml")).unwrap();
        assert_eq!(read(&root, &root.join("run/sub/relative.toml")).unwrap(), "lr = 1\n");

        // Links out, absolute or relative, to a file or through a folder, and `..` paths are not.
        symlink(outside.path().join("secret"), root.join("run/metrics.jsonl")).unwrap();
        symlink(outside.path(), root.join("run/out")).unwrap();
        symlink("../../../../../../../../../../etc/passwd", root.join("run/passwd")).unwrap();
        for p in [
            root.join("run/metrics.jsonl"),
            root.join("run/out/secret"),
            root.join("run/passwd"),
            root.join("../").join(outside.path().file_name().unwrap()).join("secret"),
        ] {
            assert!(matches!(read(&root, &p), Err(ConfineError::Outside(_))), "{}", p.display());
        }
        // A link to a link out is resolved all the way.
        symlink(root.join("run/metrics.jsonl"), root.join("run/chain")).unwrap();
        assert!(matches!(read(&root, &root.join("run/chain")), Err(ConfineError::Outside(_))));
        // Missing files and dangling links are simply absent.
        assert!(matches!(read(&root, &root.join("run/none")), Err(ConfineError::NotFound(_))));
        symlink(root.join("run/none"), root.join("run/dangling")).unwrap();
        assert!(matches!(read(&root, &root.join("run/dangling")), Err(ConfineError::NotFound(_))));
        // A folder is not a file.
        assert!(matches!(read(&root, &root.join("run/sub")), Err(ConfineError::NotAFile(_))));
    }

    #[test]
    fn a_named_pipe_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let fifo = root.join("metrics.jsonl");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // A blocking open of a pipe nobody writes to would never return.
        assert!(matches!(open_inside(&root, &fifo), Err(ConfineError::NotAFile(_))));
    }

    #[test]
    fn device_files_are_outside() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        symlink("/dev/zero", root.join("samples.jsonl")).unwrap();
        assert!(matches!(open_inside(&root, &root.join("samples.jsonl")), Err(ConfineError::Outside(_))));
    }
}
