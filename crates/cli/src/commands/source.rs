//! The model a command runs (`--checkpoint` of `sample`, `chat`, `serve`, `eval`, `bench decode`):
//! a run directory or checkpoint folder, or an `init_from`-style source, `gguf:FILE` (its
//! block-quantized projections kept in their stored types and multiplied on them), `hf:DIR` or
//! `run:DIR`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::tensor::Device;
use ember_data::Tokenizer;
use ember_hf::gguf::model::Keep;
use ember_model::{Decoder, ModelConfig};
use ember_train::config::InitSource;
use ember_train::{Checkpoint, ResolvedInit};

/// A model opened for inference: its architecture, tokenizer and tokenizer folder (chat template,
/// generation defaults) read; the weights read by [`ModelSource::decoder`].
pub struct ModelSource {
    pub model_config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// The folder of tokenizer.json, tokenizer_config.json and generation_config.json.
    pub dir: PathBuf,
    weights: Weights,
}

enum Weights {
    Run(Box<Checkpoint>),
    Init(Box<ResolvedInit>),
}

impl ModelSource {
    /// `gguf:FILE`, `hf:DIR`, `run:DIR`, or a run directory / checkpoint folder.
    pub fn open(spec: &Path) -> anyhow::Result<Self> {
        let text = spec.to_string_lossy();
        if ["gguf:", "hf:", "run:"].iter().any(|p| text.starts_with(p)) {
            let source = InitSource::parse(&text)?;
            // The source's own errors name it as `--checkpoint` gave it, not as an `init_from` key.
            let init = source.resolve().map_err(|e| match e {
                ember_train::TrainError::InitFrom { message, .. } => anyhow::anyhow!("--checkpoint {text}: {message}"),
                e => anyhow::Error::new(e).context(format!("opening {text}")),
            })?;
            let dir = init.tokenizer_dir()?;
            let tokenizer = match init.take_tokenizer() {
                Some(built) => built,
                None => Tokenizer::from_file(&dir.join("tokenizer.json"))?,
            };
            let tokenizer = tokenizer.with_model_eos(&dir);
            return Ok(Self {
                model_config: init.model_config.clone(),
                tokenizer,
                dir,
                weights: Weights::Init(Box::new(init)),
            });
        }
        let checkpoint = Checkpoint::open(spec).with_context(|| format!("opening checkpoint {}", spec.display()))?;
        Ok(Self {
            model_config: checkpoint.model_config.clone(),
            tokenizer: checkpoint.tokenizer.clone(),
            dir: checkpoint.dir.clone(),
            weights: Weights::Run(Box::new(checkpoint)),
        })
    }

    /// The model's weights on `device`; a GGUF file's block-quantized projections stay in their
    /// types.
    pub fn decoder<B: ember_kernels::EmberBackend>(&self, device: &Device<B>) -> anyhow::Result<Decoder<B>> {
        let model = self.load::<B>(device)?;
        crate::alloc::release_freed_memory();
        Ok(model)
    }

    fn load<B: ember_kernels::EmberBackend>(&self, device: &Device<B>) -> anyhow::Result<Decoder<B>> {
        Ok(match &self.weights {
            Weights::Run(c) => c.inference_decoder::<B>(device)?,
            Weights::Init(init) => init.load::<B>(Keep::Inference, device)?,
        })
    }
}
