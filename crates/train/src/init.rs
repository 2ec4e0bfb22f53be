//! Where a fine-tuning run starts: `init_from = "hf:DIR"` (a Hugging Face model folder),
//! `init_from = "gguf:FILE"` (a GGUF model, whose projections a LoRA run keeps in their stored
//! quantized types) or `init_from = "run:DIR"` (an ember run directory or checkpoint, e.g. one made
//! by `ember import`).
//!
//! The config holds the source as a typed value ([`InitSource`]); [`InitSource::resolve`] opens it,
//! once per run, and the [`ResolvedInit`] is passed along (architecture, tokenizer folder, Hugging
//! Face config, weights). A checkpoint is loaded over an opened source here too
//! ([`Checkpoint::decoder_over`]): a LoRA checkpoint's base is checked against what its
//! `inputs.json` records ([`Checkpoint::check_base`]).

use std::path::PathBuf;

use burn::tensor::{DType, Device};
use ember_hf::gguf::model::Keep;
use ember_model::{Decoder, ModelConfig};

use crate::checkpoint::{BaseRecord, Checkpoint};
use crate::config::{ConfigFile, InitSource, TrainConfig};
use crate::error::TrainError;

impl InitSource {
    /// Opens the source, once for the whole run: its architecture and Hugging Face config read,
    /// a run's checkpoint checked. The weights are read when [`ResolvedInit::load`] asks for them.
    pub fn resolve(&self) -> Result<ResolvedInit, TrainError> {
        self.check_kind()?;
        let (opened, model_config, hf_config) = match self {
            Self::Hf(dir) => {
                let path = dir.join("config.json");
                let text =
                    ember_data::read_file_to_string(&path).map_err(|e| self.err(format!("{}: {e}", path.display())))?;
                let json: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| self.err(format!("{}: {e}", path.display())))?;
                let (model, _) = ember_hf::to_model_config(&json, &path.display().to_string())
                    .map_err(|e| self.err(e.to_string()))?;
                (Opened::Hf(dir.clone()), model, Some(json))
            }
            Self::Run(dir) => {
                let ckpt = Checkpoint::open(dir)?;
                let (model, hf) = (ckpt.model_config.clone(), ckpt.hf_config());
                (Opened::Run(Box::new(ckpt)), model, hf)
            }
            Self::Gguf(path) => {
                let file = ember_hf::gguf::GgufFile::open(path).map_err(|e| self.err(e.to_string()))?;
                let (model, _, hf) = ember_hf::gguf::model::read_config(&file).map_err(|e| self.err(e.to_string()))?;
                let kept = ember_hf::gguf::model::kept_sizes(&file).map_err(|e| self.err(e.to_string()))?;
                // The tokenizer the file's metadata describes, built once: written out as `ember
                // import` writes it, for a run to read (and copy into its checkpoints), and kept for
                // a command that runs the model ([`ResolvedInit::take_tokenizer`]).
                let (built, config) =
                    ember_hf::gguf::tokenizer::tokenizer(&file).map_err(|e| self.err(e.to_string()))?;
                let json = built.to_string(false).map_err(|e| self.err(e.to_string()))?;
                let tokenizer =
                    tempfile::Builder::new().prefix("ember-gguf-tokenizer").tempdir().map_err(TrainError::io(path))?;
                let write = |name: &str, text: &str| {
                    let to = tokenizer.path().join(name);
                    std::fs::write(&to, text).map_err(TrainError::io(&to))
                };
                write("tokenizer.json", &json)?;
                let config = serde_json::to_string_pretty(&config).map_err(|e| self.err(e.to_string()))?;
                write("tokenizer_config.json", &config)?;
                let built = std::sync::Mutex::new(Some(ember_data::Tokenizer::from_tokenizers(built)));
                (Opened::Gguf { path: path.clone(), tokenizer, kept, built }, model, Some(hf))
            }
        };
        Ok(ResolvedInit { source: self.clone(), model_config, hf_config, opened, identity: Default::default() })
    }
}

impl InitSource {
    /// Refuses a path that is not what its prefix says, before it is opened, with the prefix it
    /// needs: a GGUF file given as `hf:` or `run:` ("use gguf:PATH"), a folder given as `gguf:`
    /// ("use hf:PATH" for a Hugging Face folder, "run:PATH" for an ember run), a FIFO, socket or
    /// device as any of them (never opened: a FIFO would block).
    fn check_kind(&self) -> Result<(), TrainError> {
        let (path, wants) = match self {
            Self::Hf(p) => (p, "a Hugging Face model folder"),
            Self::Run(p) => (p, "an ember run directory or checkpoint folder"),
            Self::Gguf(p) => (p, "a GGUF file"),
        };
        let shown = path.display();
        let meta = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(self.err(format!("{shown}: no such file or folder")));
            }
            Err(e) => return Err(self.err(format!("{shown}: {e}"))),
        };
        if let Some(kind) = ember_data::special_file(meta.file_type()) {
            return Err(self.err(format!("{shown} is {kind}, not {wants}")));
        }
        match self {
            Self::Hf(_) | Self::Run(_) if meta.is_file() => {
                if ember_hf::gguf::is_gguf(path).map_err(|e| self.err(e.to_string()))? {
                    return Err(self.err(format!("{shown} is a GGUF file: use gguf:{shown}")));
                }
                if matches!(self, Self::Hf(_)) {
                    return Err(self.err(format!("{shown} is a file, not {wants} (config.json, model.safetensors)")));
                }
            }
            Self::Gguf(_) if meta.is_dir() => {
                let hint = if path.join("config.json").exists() {
                    format!(" (a Hugging Face model folder): use hf:{shown}")
                } else if path.join(crate::checkpoint::CHECKPOINTS).exists()
                    || path.join(crate::checkpoint::MODEL_CONFIG_FILE).exists()
                {
                    format!(" (an ember run): use run:{shown}")
                } else {
                    String::new()
                };
                return Err(self.err(format!("{shown} is a folder, not {wants}{hint}")));
            }
            _ => {}
        }
        Ok(())
    }
}

/// An `init_from` source, opened: what a run takes from it, read once.
#[derive(Debug)]
pub struct ResolvedInit {
    pub source: InitSource,
    /// The architecture of the starting model.
    pub model_config: ModelConfig,
    /// The source's Hugging Face config.json (a run's: the one its model was imported from),
    /// carried to exports.
    pub hf_config: Option<serde_json::Value>,
    opened: Opened,
    /// The digests of its weights files, computed on first use ([`ResolvedInit::identity`]).
    pub(crate) identity: std::sync::OnceLock<BaseRecord>,
}

#[derive(Debug)]
enum Opened {
    Hf(PathBuf),
    Run(Box<Checkpoint>),
    /// The file, and its tokenizer written to a folder of its own (removed when the run ends).
    /// With (weights, bytes) of the projections a LoRA run keeps quantized.
    Gguf {
        path: PathBuf,
        tokenizer: tempfile::TempDir,
        kept: (u64, u64),
        /// The tokenizer built from the metadata, until [`ResolvedInit::take_tokenizer`] takes it
        /// or the weights are loaded (a run reads its tokenizer.json instead).
        built: std::sync::Mutex<Option<ember_data::Tokenizer>>,
    },
}

impl ResolvedInit {
    /// (weights, bytes) of the projections that [`Self::load`] with `keep_quantized` keeps in their
    /// stored types: a GGUF file's block-quantized ones; none for any other source.
    pub(crate) fn kept_quantized(&self) -> (u64, u64) {
        match &self.opened {
            Opened::Gguf { kept, .. } => *kept,
            _ => (0, 0),
        }
    }

    /// A GGUF file's tokenizer as built from its metadata (once: later calls and other sources give
    /// `None`), which spares reading its tokenizer.json back.
    pub fn take_tokenizer(&self) -> Option<ember_data::Tokenizer> {
        match &self.opened {
            Opened::Gguf { built, .. } => built.lock().ok()?.take(),
            _ => None,
        }
    }

    /// The folder whose tokenizer.json (and chat template) the run uses.
    pub fn tokenizer_dir(&self) -> Result<PathBuf, TrainError> {
        let dir: &std::path::Path = match &self.opened {
            Opened::Hf(dir) => dir,
            Opened::Run(ckpt) => &ckpt.dir,
            Opened::Gguf { tokenizer, .. } => tokenizer.path(),
        };
        if !dir.join("tokenizer.json").is_file() {
            return Err(self.source.err(format!("{}: no tokenizer.json", dir.display())));
        }
        Ok(dir.to_path_buf())
    }

    /// The starting weights, as f32 parameters, except what `keep` keeps of a GGUF file in its
    /// stored block types: nothing, the projections (the frozen base of LoRA), or for inference the
    /// embedding table and LM head too (products on the stored blocks).
    pub fn load<B: ember_kernels::EmberBackend>(
        &self,
        keep: Keep,
        device: &Device<B>,
    ) -> Result<Decoder<B>, TrainError> {
        // Not taken by now, the built tokenizer is not wanted (a run reads tokenizer.json): its
        // memory (tens of MB for a 262k vocabulary) goes before the weights come.
        drop(self.take_tokenizer());
        match &self.opened {
            Opened::Gguf { path, .. } => {
                use ember_hf::gguf::model::{import, import_for_inference, import_keeping};
                let imported = match keep {
                    Keep::Nothing => import::<B>(path, DType::F32, device),
                    Keep::Projections => import_keeping::<B>(path, device),
                    Keep::Inference => import_for_inference::<B>(path, device),
                };
                let imported = imported.map_err(|e| self.source.err(e.to_string()))?;
                let bf16 = ember_hf::gguf::GgmlType::Bf16.name();
                // Norms are F32 in every GGUF file: a block's bf16 tensor is a projection.
                let stored_bf16 = imported.stored.iter().any(|(name, kind)| name.starts_with("blk.") && *kind == bf16);
                let model = inference_dtype(imported.imported.model, keep, stored_bf16);
                let (kept, bytes) = model.quantized_projections();
                let table = match &model.embed_tokens {
                    ember_model::Weight::Stored(table) => table.blocks.stored_bytes(),
                    ember_model::Weight::Dense(_) => 0,
                };
                let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
                if table > 0 {
                    tracing::info!(
                        "{kept} projections ({:.1} MiB) and the embedding table ({:.1} MiB) kept quantized",
                        mib(bytes),
                        mib(table)
                    );
                } else if kept > 0 {
                    tracing::info!("{kept} projections kept quantized ({:.1} MiB)", mib(bytes));
                }
                Ok(model)
            }
            // `import` reads config.json again, beside the weights (crates/hf reads a folder whole).
            Opened::Hf(dir) => {
                let model = ember_hf::import::<B>(dir, DType::F32, false, false, device)
                    .map_err(|e| self.source.err(e.to_string()))?
                    .model;
                let files: Vec<PathBuf> = std::fs::read_dir(dir)
                    .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
                    .unwrap_or_default();
                let files: Vec<PathBuf> =
                    files.into_iter().filter(|f| f.extension().is_some_and(|e| e == "safetensors")).collect();
                Ok(inference_dtype(model, keep, projections_in_bf16(&files)))
            }
            // A LoRA run starts the next one as base + adapters, folded into the weights (the next
            // run's own adapters, if any, then train on top of them; a full fine-tune gets f32
            // weights throughout).
            Opened::Run(ckpt) => match ckpt.adapter_source()? {
                Some(_) => {
                    let base_keep = if keep == Keep::Nothing { Keep::Nothing } else { Keep::Projections };
                    let model = ckpt.decoder_keeping::<B>(None, base_keep, device)?.merged_for_training();
                    tracing::info!(
                        run = %ckpt.dir.display(),
                        "init_from is a LoRA run: its adapters are merged into its base's weights"
                    );
                    Ok(model)
                }
                None if keep == Keep::Inference => ckpt.inference_decoder::<B>(device),
                None => ckpt.decoder::<B>(device),
            },
        }
    }
}

/// A model loaded for inference (`keep` [`Keep::Inference`]) from weights stored in bf16 keeps its
/// projections in bf16 ([`Decoder::with_bf16_projections`]: decoding reads half the bytes of their
/// f32 widening); any other load, and a model stored in f32, as it is.
fn inference_dtype<B: ember_kernels::EmberBackend>(model: Decoder<B>, keep: Keep, stored_bf16: bool) -> Decoder<B> {
    if keep != Keep::Inference || !stored_bf16 {
        return model;
    }
    let model = model.with_bf16_projections();
    tracing::info!("the projections kept in bf16, as stored");
    model
}

/// Whether the safetensors files `files` store their projection weights (`*_proj.weight`) in bf16,
/// read from the files' headers alone.
pub(crate) fn projections_in_bf16(files: &[PathBuf]) -> bool {
    files
        .iter()
        .any(|f| header_dtypes(f).is_some_and(|d| d.iter().any(|(k, t)| k.ends_with("_proj.weight") && t == "BF16")))
}

/// A safetensors file's tensors and their dtypes, from its header (`None` where it cannot be read:
/// the load that follows names the problem).
fn header_dtypes(file: &std::path::Path) -> Option<Vec<(String, String)>> {
    use std::io::Read;
    let mut f = std::fs::File::open(file).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    // safetensors' own limit on a header.
    if len > 100 << 20 {
        return None;
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).ok()?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header).ok()?;
    let dtype = |v: &serde_json::Value| v.get("dtype").and_then(|d| d.as_str()).map(str::to_owned);
    Some(header.iter().filter_map(|(k, v)| Some((k.clone(), dtype(v)?))).collect())
}

/// A config ready to run: complete, with its `init_from` source (if any) opened once, to be passed
/// along to whatever needs the source.
#[derive(Debug)]
pub struct ResolvedConfig {
    pub config: TrainConfig,
    /// `Some` exactly when `config.init_from` is.
    pub init: Option<ResolvedInit>,
}

impl ConfigFile {
    /// Opens the file's `init_from` source (once) and completes the config: a `[model]` left out
    /// is the source's.
    pub fn resolve(self) -> Result<ResolvedConfig, TrainError> {
        let init = self.config.init_from.as_ref().map(InitSource::resolve).transpose()?;
        let config = match &init {
            Some(init) if self.config.model.is_none() => self.complete_with(init.model_config.clone())?,
            _ => self.complete()?,
        };
        Ok(ResolvedConfig { config, init })
    }
}

impl TrainConfig {
    /// Opens the config's `init_from` source (once), for a run of it.
    pub fn resolve(self) -> Result<ResolvedConfig, TrainError> {
        let init = self.init_from.as_ref().map(InitSource::resolve).transpose()?;
        Ok(ResolvedConfig { config: self, init })
    }
}

impl Checkpoint {
    /// [`Checkpoint::decoder`] for inference: a full checkpoint whose projections are stored in bf16
    /// (`ember import --dtype bf16`) keeps them so ([`Decoder::with_bf16_projections`]).
    pub fn inference_decoder<B: ember_kernels::EmberBackend>(
        &self,
        device: &Device<B>,
    ) -> Result<Decoder<B>, TrainError> {
        Ok(inference_dtype(self.decoder(device)?, Keep::Inference, self.stores_bf16_projections()))
    }

    /// The decoder with this checkpoint's weights (for a LoRA checkpoint: the base model with the
    /// adapters attached; its `init_from` source is opened for it).
    pub fn decoder<B: ember_kernels::EmberBackend>(&self, device: &Device<B>) -> Result<Decoder<B>, TrainError> {
        self.decoder_over(None, device)
    }

    /// [`Checkpoint::decoder`], the base of a LoRA checkpoint taken from `base` where its
    /// `init_from` source is already open (the caller's, checked to be the checkpoint's).
    pub fn decoder_over<B: ember_kernels::EmberBackend>(
        &self,
        base: Option<&ResolvedInit>,
        device: &Device<B>,
    ) -> Result<Decoder<B>, TrainError> {
        self.decoder_keeping(base, Keep::Projections, device)
    }

    /// [`Checkpoint::decoder_over`], a LoRA checkpoint's base loaded keeping what `keep` says of
    /// a GGUF file's stored blocks.
    pub(crate) fn decoder_keeping<B: ember_kernels::EmberBackend>(
        &self,
        base: Option<&ResolvedInit>,
        keep: Keep,
        device: &Device<B>,
    ) -> Result<Decoder<B>, TrainError> {
        let Some(source) = self.adapter_source()? else {
            return self.own_decoder(device);
        };
        let opened;
        let base = match base {
            Some(base) => base,
            None => {
                opened = source.resolve()?;
                &opened
            }
        };
        // The weights under the adapters must be the ones they were trained on.
        self.check_base(base)?;
        self.with_adapters(base.load::<B>(keep, device)?)
    }
}

impl ResolvedInit {
    /// The identity of the source's weights ([`BaseRecord::of`]), computed once per opened source.
    pub(crate) fn identity(&self) -> Result<&BaseRecord, TrainError> {
        if let Some(record) = self.identity.get() {
            return Ok(record);
        }
        let record = BaseRecord::of(&self.source)?;
        Ok(self.identity.get_or_init(|| record))
    }
}

impl Checkpoint {
    /// Refuses `base` for this LoRA checkpoint where its weights are not the ones the run was
    /// trained on (as its `inputs.json` records them); a checkpoint without the record (an older
    /// ember) is loaded over whatever the source holds now.
    pub(crate) fn check_base(&self, base: &ResolvedInit) -> Result<(), TrainError> {
        let Some(then) = self.inputs.as_ref().and_then(|i| i.base.as_ref()) else {
            tracing::debug!(dir = %self.dir.display(), "no record of the base's weights: not checked");
            return Ok(());
        };
        if BaseRecord::same_stamps(&base.source, then) {
            return Ok(());
        }
        let Some(change) = base.identity()?.changes_since(then) else { return Ok(()) };
        let what = match &base.source {
            InitSource::Gguf(_) => "file",
            InitSource::Hf(_) => "folder",
            InitSource::Run(_) => "run (or one of its checkpoints)",
        };
        Err(TrainError::Config {
            path: self.dir.clone(),
            key: None,
            message: format!(
                "its base {} changed since the run was trained ({change}); point init_from at the original {what}",
                base.source
            ),
        })
    }
}
