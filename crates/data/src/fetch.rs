//! Finding a dataset file on disk, or downloading it into the cache, and checking it against its
//! manifest.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};
use crate::manifest::Manifest;

/// Where dataset files are looked for, in order.
#[derive(Debug, Clone)]
pub struct Locations {
    /// The repository's `datasets/` folder (relative to the working directory by default).
    pub repo_dir: PathBuf,
    /// A folder of datasets the user points at (`$EMBER_DATA_DIR` for the binary).
    pub data_dir: Option<PathBuf>,
    /// ember's cache: downloads go to `<cache>/datasets/<name>/`.
    pub cache_dir: PathBuf,
}

impl Locations {
    fn candidates(&self, m: &Manifest) -> Vec<PathBuf> {
        let mut out = vec![self.repo_dir.join(&m.name).join(&m.file)];
        if let Some(dir) = &self.data_dir {
            out.push(dir.join(&m.name).join(&m.file));
        }
        out.push(self.cached(m));
        out
    }

    fn cached(&self, m: &Manifest) -> PathBuf {
        self.cache_dir.join("datasets").join(&m.name).join(&m.file)
    }
}

/// Lower-case hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(DataError::io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(DataError::io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn verify(path: &Path, m: &Manifest) -> Result<()> {
    let size = std::fs::metadata(path).map_err(DataError::io(path))?.len();
    if size != m.size {
        return Err(DataError::Size { path: path.into(), expected: m.size, found: size });
    }
    let found = sha256_file(path)?;
    if found != m.sha256 {
        return Err(DataError::Checksum { path: path.into(), expected: m.sha256.clone(), found });
    }
    Ok(())
}

/// The path of the manifest's file: the first candidate that exists (and checks out), else a fresh
/// download into the cache. A file that exists but does not match the manifest is an error, except
/// in the cache, where it is replaced.
pub fn locate(m: &Manifest, loc: &Locations) -> Result<PathBuf> {
    let cached = loc.cached(m);
    for path in loc.candidates(m) {
        if !path.is_file() {
            continue;
        }
        match verify(&path, m) {
            Ok(()) => {
                tracing::debug!(path = %path.display(), "dataset found");
                return Ok(path);
            }
            Err(e) if path == cached => {
                tracing::warn!("{e}; downloading it again");
            }
            Err(e) => return Err(e),
        }
    }
    tracing::info!(url = %m.url, "downloading {}", m.name);
    match download(&m.url, &cached, m) {
        Ok(()) => Ok(cached),
        Err(e) => Err(DataError::NotFound {
            name: m.name.clone(),
            file: m.file.clone(),
            sha256: m.sha256.clone(),
            reason: e.to_string(),
            places: loc.candidates(m).iter().map(|p| format!("    {}", p.display())).collect::<Vec<_>>().join("\n"),
        }),
    }
}

/// Downloads `url` to `dest` through a temporary file in the same folder, checking size and sha256
/// before the rename, so that `dest` is either absent or complete and correct.
pub fn download(url: &str, dest: &Path, m: &Manifest) -> Result<()> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(10))
        .timeout_read(Duration::from_secs(60))
        .build();
    let response = agent.get(url).call().map_err(|e| DataError::Download(format!("GET {url}: {e}")))?;
    let len = response.header("Content-Length").and_then(|v| v.parse::<u64>().ok()).unwrap_or(m.size);
    let bar = ProgressBar::new(len).with_message(m.name.clone());
    bar.set_style(
        ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template"),
    );
    let tmp = dir.join(format!(".{}.part-{}", m.file, std::process::id()));
    let result = (|| {
        let mut out = File::create(&tmp).map_err(DataError::io(&tmp))?;
        let mut reader = response.into_reader().take(m.size + 1);
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            let n = reader.read(&mut buf).map_err(|e| DataError::Download(format!("reading {url}: {e}")))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(DataError::io(&tmp))?;
            total += n as u64;
            bar.set_position(total);
        }
        out.sync_all().map_err(DataError::io(&tmp))?;
        if total != m.size {
            return Err(DataError::Size { path: url.into(), expected: m.size, found: total });
        }
        let found = hex(&hasher.finalize());
        if found != m.sha256 {
            return Err(DataError::Checksum { path: url.into(), expected: m.sha256.clone(), found });
        }
        std::fs::rename(&tmp, dest).map_err(DataError::io(dest))
    })();
    bar.finish_and_clear();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;

    /// A one-file HTTP/1.1 server on loopback that answers `count` requests with `body`.
    fn serve(body: Vec<u8>, count: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(count) {
                let mut stream = stream.unwrap();
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap() > 2 {
                    line.clear();
                }
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                stream.write_all(head.as_bytes()).unwrap();
                stream.write_all(&body).unwrap();
            }
        });
        format!("http://{addr}/input.txt")
    }

    fn manifest_for(body: &[u8], url: String) -> Manifest {
        Manifest {
            name: "tiny".into(),
            file: "input.txt".into(),
            url,
            size: body.len() as u64,
            sha256: hex(&Sha256::digest(body)),
            license: "test".into(),
            val_fraction: 0.1,
        }
    }

    fn locations(root: &Path) -> Locations {
        Locations { repo_dir: root.join("repo"), data_dir: Some(root.join("data")), cache_dir: root.join("cache") }
    }

    #[test]
    fn downloads_into_the_cache_once_and_checks_the_hash() {
        let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let url = serve(body.clone(), 1);
        let dir = tempfile::tempdir().unwrap();
        let loc = locations(dir.path());
        let m = manifest_for(&body, url);
        let path = locate(&m, &loc).unwrap();
        assert_eq!(path, dir.path().join("cache/datasets/tiny/input.txt"));
        assert_eq!(std::fs::read(&path).unwrap(), body);
        // Second call: found in the cache (the server answers only one request).
        assert_eq!(locate(&m, &loc).unwrap(), path);
    }

    #[test]
    fn a_wrong_download_is_rejected_and_leaves_nothing() {
        let body = b"not the file".to_vec();
        let url = serve(body.clone(), 1);
        let dir = tempfile::tempdir().unwrap();
        let loc = locations(dir.path());
        let mut m = manifest_for(&body, url);
        m.sha256 = "0".repeat(64);
        let e = locate(&m, &loc).unwrap_err().to_string();
        assert!(e.contains("sha256 is") && e.contains("Put `input.txt`"), "{e}");
        assert!(!dir.path().join("cache/datasets/tiny/input.txt").exists());
        let leftovers = std::fs::read_dir(dir.path().join("cache/datasets/tiny")).unwrap().count();
        assert_eq!(leftovers, 0);
    }

    #[test]
    fn offline_error_says_where_to_put_the_file() {
        // Port 9 on loopback: nothing listens, the connection is refused at once.
        let dir = tempfile::tempdir().unwrap();
        let loc = locations(dir.path());
        let m = manifest_for(b"abc", "http://127.0.0.1:9/input.txt".into());
        let e = locate(&m, &loc).unwrap_err().to_string();
        assert!(e.contains("dataset `tiny` not found"), "{e}");
        assert!(e.contains(&dir.path().join("repo/tiny/input.txt").display().to_string()), "{e}");
        assert!(e.contains(&dir.path().join("data/tiny/input.txt").display().to_string()), "{e}");
    }

    #[test]
    fn finds_the_repo_copy_before_the_data_dir_and_rejects_a_bad_one() {
        let dir = tempfile::tempdir().unwrap();
        let loc = locations(dir.path());
        let body = b"hello shakespeare".to_vec();
        let m = manifest_for(&body, "http://127.0.0.1:9/x".into());
        std::fs::create_dir_all(dir.path().join("data/tiny")).unwrap();
        std::fs::write(dir.path().join("data/tiny/input.txt"), &body).unwrap();
        assert_eq!(locate(&m, &loc).unwrap(), dir.path().join("data/tiny/input.txt"));
        std::fs::create_dir_all(dir.path().join("repo/tiny")).unwrap();
        std::fs::write(dir.path().join("repo/tiny/input.txt"), b"hello shakespearE").unwrap();
        let e = locate(&m, &loc).unwrap_err().to_string();
        assert!(e.contains("repo/tiny/input.txt: sha256 is"), "{e}");
    }
}
