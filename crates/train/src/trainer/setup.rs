//! What a run reads but does not change: its config completed by the data (the vocabulary), the
//! tokenizer and both splits; the model a fresh run starts from; the memory check before it is built.

use std::path::PathBuf;

use burn::tensor::Device;
use ember_data::fetch::Locations;
use ember_data::{Examples, Tokenizer};
use ember_hf::gguf::model::Keep;
use ember_kernels::{Compute, TrainBackend};
use ember_model::lora::Target;
use ember_model::Decoder;

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::flops::Peak;
use crate::init::{ResolvedConfig, ResolvedInit};

/// Everything the loop reads but does not change.
pub(crate) struct Setup {
    pub(crate) config: TrainConfig,
    /// The `init_from` source, opened once for the whole run.
    pub(crate) init: Option<ResolvedInit>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) tokenizer_dir: Option<PathBuf>,
    pub(crate) train: Examples,
    pub(crate) val: Examples,
    /// Fine-tuning data: the first held-out example's prompt (see [`crate::data::LoadedData`]).
    pub(crate) held_out_prompt: Option<String>,
    /// Reinforcement learning's prompts.
    pub(crate) prompts: Option<crate::rl::Prompts>,
    /// The training data's file (and shard), recorded in the checkpoints.
    pub(crate) data_origin: crate::data::DataOrigin,
}

/// Finds the data, fills in the vocabulary size (and a length given in epochs, with `ranks`
/// sharing each step) and checks that both splits hold a window.
pub(crate) fn prepare(run: ResolvedConfig, locations: &Locations, ranks: usize) -> Result<Setup, TrainError> {
    let ResolvedConfig { mut config, init } = run;
    config.absolutize_paths();
    let data = crate::data::load(&config, init.as_ref(), locations)?;
    // A seq_len left out is the data's (the longest example's, for fine-tuning examples).
    config.train.seq_len = Some(data.seq_len);
    let rows = burn::data::dataset::Dataset::len(data.train.as_ref());
    config.resolve_epochs(rows, ranks).map_err(|error| TrainError::Invalid { path: "config".into(), error })?;
    let vocab = data.tokenizer.vocab_size();
    if config.model.vocab_size == 0 {
        config.model.vocab_size = vocab;
    } else if config.model.vocab_size < vocab {
        return Err(TrainError::VocabTooSmall { config: config.model.vocab_size, tokenizer: vocab });
    }
    config.model.validate()?;
    Ok(Setup {
        config,
        init,
        tokenizer: data.tokenizer,
        tokenizer_dir: data.tokenizer_dir,
        train: data.train,
        val: data.val,
        held_out_prompt: data.held_out_prompt,
        prompts: data.prompts,
        data_origin: data.origin,
    })
}

/// The model a fresh run starts from: random weights, or `init_from`'s (with LoRA adapters when
/// configured, everything else frozen).
pub(crate) fn initial_model<B: TrainBackend>(setup: &Setup, device: &Device<B>) -> Result<Decoder<B>, TrainError> {
    let config = &setup.config;
    let Some(init) = &setup.init else {
        let model = Decoder::<B>::new(&config.model, config.train.seed, device)?;
        // Adapters on a random base: only a benchmark's config gets here (a run's needs init_from).
        return Ok(match &config.lora {
            Some(lora) => model.with_lora(lora, config.train.seed),
            None => model,
        });
    };
    let keep = if config.lora.is_some() { Keep::Projections } else { Keep::Nothing };
    let model = init.load::<B>(keep, device)?;
    if model.config() != &config.model {
        return Err(init
            .source
            .err("its architecture differs from the config's [model]; leave [model] out to take the model's"));
    }
    B::seed(device, config.train.seed);
    Ok(match &config.lora {
        Some(lora) => model.with_lora(lora, config.train.seed),
        None => model,
    })
}

/// Fails before the model is built when the estimated memory of the run exceeds what the device has.
pub(super) fn check_fits(config: &TrainConfig, kept: (u64, u64), available: Option<u64>) -> Result<(), TrainError> {
    let e = crate::memory::estimate_keeping(config, trainable_params(config), kept);
    let terms = e.terms.iter().map(|(k, v)| format!("{k} {}", crate::memory::gib(*v))).collect::<Vec<_>>().join(", ");
    tracing::info!("estimated training memory {} ({terms})", crate::memory::gib(e.total));
    match available {
        Some(have) if e.total > have => {
            Err(TrainError::DoesNotFit { need: crate::memory::gib(e.total), have: crate::memory::gib(have), terms })
        }
        _ => Ok(()),
    }
}

/// Parameters that receive gradients, from the config alone: all of them, or the LoRA adapters
/// (`r·(d_in + d_out)` per adapted projection and layer).
fn trainable_params(config: &TrainConfig) -> u64 {
    let m = &config.model;
    let Some(lora) = &config.lora else { return m.num_params() };
    // Each target once, as `Decoder::with_lora` adds them.
    let targets = Target::ALL.into_iter().filter(|t| lora.targets.contains(t));
    let per_layer: u64 = targets.map(|t| t.shape(m)).map(|(i, o)| (i + o) as u64).sum();
    lora.rank as u64 * per_layer * m.n_layers as u64
}

/// Logs the model, its FLOPs per token and the device's peak, for MFU.
pub(super) fn log_setup(config: &TrainConfig, compute: &Compute, peak: &Peak, tokens_per_step: usize) {
    let (m, dtype) = (&config.model, compute.dtype);
    let ffn = match &m.moe {
        Some(e) => format!(
            "{} experts of {} (top {}{})",
            e.n_experts,
            e.d_expert,
            e.top_k,
            e.shared_expert.map_or(String::new(), |s| format!(", a shared one of {s}"))
        ),
        None => format!("d_ff {}", m.d_ff),
    };
    let ffn = match m.moe.as_ref().map(|e| e.dense_layers).filter(|&d| d > 0) {
        Some(dense) => format!("{ffn} after {dense} dense layer(s) of d_ff {}", m.d_ff),
        None => ffn,
    };
    let heads = match &m.mla {
        Some(a) => format!(
            "{} heads of latent attention (a {}-wide key/value latent{}, heads {} + {} rotary, values {})",
            m.n_heads,
            a.kv_rank,
            a.q_rank.map_or(String::new(), |q| format!(", a {q}-wide query")),
            a.nope_dim,
            a.rope_dim,
            a.v_dim
        ),
        None => format!("{} heads ({} kv)", m.n_heads, m.n_kv_heads()),
    };
    tracing::info!(
        "model: {} layers, d_model {}, {heads}, {ffn}, vocab {}: {} parameters; {tokens_per_step} tokens per step; GEMMs in {dtype:?}",
        m.n_layers,
        m.d_model,
        m.vocab_size,
        m.num_params()
    );
    let formula = if config.lora.is_some() {
        "4N + 6·L·Σ r·(in + out) + 12·L·T·d, LoRA on a frozen base"
    } else {
        "6N + 12·L·T·d"
    };
    tracing::info!(
        "MFU = ({formula}) · tokens/s / peak, N = {} matmul parameters, L = {}, T = {}, d = {}: {:.4e} FLOPs per token; peak {:.3} TFLOP/s ({})",
        m.matmul_params(),
        m.n_layers,
        config.seq_len(),
        m.n_heads * m.head_dim(),
        config.train_flops_per_token(),
        peak.flops / 1e12,
        peak.source
    );
}
