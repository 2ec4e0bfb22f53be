//! The training data of a config: find the text, tokenize it into cached shards.

use std::path::{Path, PathBuf};

use ember_data::fetch::{locate, Locations};
use ember_data::prepare::prepare_cached;
use ember_data::{Manifest, Prepared, TokenizerSpec};

use crate::config::DataConfig;
use crate::error::TrainError;

/// The text file a data config names, found or downloaded, and its validation fraction.
pub fn text_source(config: &DataConfig, locations: &Locations) -> Result<(PathBuf, f64), TrainError> {
    match (&config.dataset, &config.path) {
        (Some(name), _) => {
            let manifest = Manifest::built_in(name)?;
            let path = locate(&manifest, locations)?;
            Ok((path, config.val_fraction.unwrap_or(manifest.val_fraction)))
        }
        (None, Some(path)) => {
            if !path.is_file() {
                return Err(TrainError::Io {
                    path: path.clone(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "data.path: no such text file"),
                });
            }
            Ok((path.clone(), config.val_fraction.unwrap_or(0.1)))
        }
        (None, None) => unreachable!("validated: data.dataset or data.path is set"),
    }
}

/// Train/val shards and the tokenizer, prepared under `<cache>/prepared/`.
pub fn load(config: &DataConfig, locations: &Locations) -> Result<Prepared, TrainError> {
    let (path, val_fraction) = text_source(config, locations)?;
    let spec: TokenizerSpec = config.tokenizer.parse()?;
    let root: &Path = &locations.cache_dir.join("prepared");
    Ok(prepare_cached(&path, &spec, val_fraction, root)?)
}
