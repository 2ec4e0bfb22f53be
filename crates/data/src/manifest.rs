//! Dataset manifests: where a corpus comes from and how to check it, committed instead of the data.

use std::path::Path;

use serde::Deserialize;

use crate::error::{DataError, Result};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    /// File name of the text, e.g. `input.txt`.
    pub file: String,
    /// Download address.
    pub url: String,
    /// Size in bytes.
    pub size: u64,
    /// Lower-case hex sha256 of the file.
    pub sha256: String,
    pub license: String,
    /// Fraction of the text (by characters, from the end) held out for validation.
    pub val_fraction: f64,
}

/// Manifests compiled into the binary, so that the default job runs from any directory.
const BUILT_IN: &[(&str, &str)] =
    &[("tinyshakespeare", include_str!("../../../datasets/tinyshakespeare/manifest.toml"))];

impl Manifest {
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let m: Manifest =
            toml::from_str(text).map_err(|e| DataError::Manifest { path: path.into(), message: e.to_string() })?;
        let bad = |message: String| DataError::Manifest { path: path.into(), message };
        if m.sha256.len() != 64 || !m.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!("sha256 `{}` is not 64 hex digits", m.sha256)));
        }
        if !(m.val_fraction > 0.0 && m.val_fraction < 1.0) {
            return Err(bad(format!("val_fraction {} is not in (0, 1)", m.val_fraction)));
        }
        if m.file.contains('/') || m.file.contains('\\') || m.file == ".." {
            return Err(bad(format!("file `{}` must be a plain file name", m.file)));
        }
        Ok(m)
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(DataError::io(path))?;
        Self::parse(&text, path)
    }

    /// A manifest compiled into ember, by dataset name.
    pub fn built_in(name: &str) -> Result<Self> {
        let (_, text) = BUILT_IN.iter().find(|(n, _)| *n == name).ok_or_else(|| DataError::UnknownDataset {
            name: name.into(),
            known: BUILT_IN.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        })?;
        Self::parse(text, Path::new(&format!("<built-in {name}>")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_tinyshakespeare() {
        let m = Manifest::built_in("tinyshakespeare").unwrap();
        assert_eq!(m.size, 1_115_394);
        assert_eq!(m.file, "input.txt");
        let e = Manifest::built_in("nope").unwrap_err().to_string();
        assert!(e.contains("unknown dataset `nope`") && e.contains("tinyshakespeare"), "{e}");
    }

    #[test]
    fn bad_manifests_name_the_field() {
        let ok = include_str!("../../../datasets/tinyshakespeare/manifest.toml");
        let p = Path::new("m.toml");
        let e = Manifest::parse(&format!("{ok}\nmirror = \"x\"\n"), p).unwrap_err().to_string();
        assert!(e.contains("unknown field `mirror`"), "{e}");
        let e = Manifest::parse(&ok.replace("86c4e6aa", "zz"), p).unwrap_err().to_string();
        assert!(e.contains("not 64 hex digits"), "{e}");
        let e = Manifest::parse(&ok.replace("val_fraction = 0.1", "val_fraction = 1.5"), p).unwrap_err().to_string();
        assert!(e.contains("val_fraction 1.5"), "{e}");
    }
}
