//! `ember serve`: an OpenAI-compatible server with continuous batching.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use burn::tensor::Device;
use clap::builder::RangedU64ValueParser;
use clap::Args;
use ember_data::finetune::ChatTemplate;
use ember_generate::engine::{Engine, EngineConfig};
use ember_kernels::TrainBackend;
use ember_serve::sampling::ChatDefaults;
use ember_serve::{Limits, Options, Server, Worker};

use crate::backend::{dispatch, DeviceSpec, Job};
use crate::commands::source::ModelSource;

#[derive(Args, Debug)]
#[command(after_help = super::chat::SAMPLING_HELP)]
pub struct ServeArgs {
    /// A run directory (its latest checkpoint) or a checkpoint folder inside it, or `gguf:FILE` (run on its stored
    /// quantized weights) or `hf:DIR`.
    #[arg(long)]
    checkpoint: PathBuf,
    #[command(flatten)]
    kv_cache: super::KvCacheFlag,
    /// Address to listen on; loopback unless you mean to expose the model.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model's name in the API (default: the checkpoint folder's name).
    #[arg(long)]
    model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` (also read from EMBER_API_KEY); not empty. The chat
    /// page at `/` is served without it and asks for it.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests decoded together (continuous batching slots), 1 to 256.
    #[arg(long, default_value_t = 8, value_parser = RangedU64ValueParser::<usize>::new().range(1..=256))]
    slots: usize,
    /// Requests that may wait for a slot before the server answers 429, 0 to 4096.
    #[arg(long, default_value_t = 64, value_parser = RangedU64ValueParser::<usize>::new().range(0..=4096))]
    queue: usize,
    /// Prompt tokens a request prefills per step (long prompts do not stall the others), 1 to 65536.
    #[arg(long, default_value_t = 256, value_parser = RangedU64ValueParser::<usize>::new().range(1..=65536))]
    prefill_chunk: usize,
    /// Positions per KV-cache block, 1 to 4096 (and at most the model's context).
    #[arg(long, default_value_t = 64, value_parser = RangedU64ValueParser::<usize>::new().range(1..=4096))]
    block_size: usize,
    /// Prefill every prompt in full, instead of starting a request from the longest prefix of its
    /// prompt that the cache holds (a shared system prompt, an earlier turn), its blocks shared.
    #[arg(long)]
    no_prefix_sharing: bool,
    /// Host names answered besides localhost and the listening address (repeatable), for a
    /// server reached by name.
    #[arg(long)]
    allow_host: Vec<String>,
    /// Open connections at most, 1 to 65536 (and half the file descriptors the process may
    /// open). When all are taken, the one idle longest is closed to make room.
    #[arg(long, default_value_t = 256, value_parser = RangedU64ValueParser::<usize>::new().range(1..=65536))]
    max_connections: usize,
    /// On SIGTERM or Ctrl-C the server takes no new requests and gives the answers in work this
    /// many seconds to finish, 0 to 600; then streams end with an error event (`server_shutdown`)
    /// and `data: [DONE]`, whole answers with 503, and it exits (status 0) within about 3 s more.
    /// A second signal stops at once.
    // `--shutdown-grace` was its name before; kept, hidden, for the scripts that use it.
    #[arg(long, alias = "shutdown-grace", value_name = "SECONDS", default_value_t = 5,
          value_parser = RangedU64ValueParser::<u64>::new().range(0..=600))]
    drain_seconds: u64,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
}

pub fn serve(mut args: ServeArgs) -> anyhow::Result<()> {
    args.api_key = args.api_key.take().or_else(crate::env::api_key);
    anyhow::ensure!(
        args.api_key.as_ref().is_none_or(|k| !k.trim().is_empty()),
        "--api-key (or EMBER_API_KEY) is empty: every request would be refused; give a key or leave both unset"
    );
    let checkpoint = ModelSource::open(&args.checkpoint)?;
    let template = ChatTemplate::from_dir(&checkpoint.dir)?;
    if template.is_none() {
        tracing::warn!("{} has no chat template: /v1/chat/completions will answer 400", checkpoint.dir.display());
    }
    let defaults = ChatDefaults::for_checkpoint(&checkpoint.dir)?;
    tracing::info!("requests that set no sampling get {}", defaults.describe());
    let device = args.device;
    dispatch(device, false, ServeJob { args, checkpoint, template, defaults })
}

struct ServeJob {
    args: ServeArgs,
    checkpoint: ModelSource,
    template: Option<ChatTemplate>,
    defaults: ChatDefaults,
}

impl Job for ServeJob {
    type Output = ();
    fn run<B: TrainBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<()> {
        let Self { args, checkpoint, template, defaults } = self;
        // A seeded request answers the same whatever runs beside it and however its prompt is
        // split (a shared prefix, chunks): prompts on the decode steps' integer products.
        let compute = args.kv_cache.apply(crate::env::compute().with_uniform_products(true));
        let model = checkpoint.decoder::<B::InnerBackend>(&device)?.with_compute(compute);
        let (context, vocab_size) = (model.config().max_seq_len, model.config().vocab_size);
        anyhow::ensure!(
            args.block_size <= context,
            "--block-size {} is larger than the model's context of {context} positions",
            args.block_size
        );
        let config = EngineConfig {
            slots: args.slots,
            queue_limit: args.queue,
            prefill_chunk: args.prefill_chunk,
            block_size: args.block_size,
            share_prefixes: !args.no_prefix_sharing,
        };
        let worker = Worker::spawn(Engine::new(model, config)).context("starting the engine's thread")?;
        let model_name = args.model_name.clone().unwrap_or_else(|| folder_name(&args.checkpoint));
        let limits = Limits { max_connections: args.max_connections, ..Limits::default() };
        let options = Options {
            model_name: model_name.clone(),
            tokenizer: checkpoint.tokenizer.clone(),
            template,
            context,
            vocab_size,
            sampling: defaults.sampling,
            allowed_hosts: args.allow_host.clone(),
            api_key: args.api_key.clone(),
            limits,
        };
        let server = Server::start(SocketAddr::new(args.host, args.port), worker, options)?;
        tracing::info!("serving `{model_name}` on {name} with {} slots", args.slots);
        crate::signals::catch_stop().context("asking for SIGTERM and SIGINT")?;
        // Tests and scripts read this line for the port.
        println!("listening on http://{}", server.addr());
        std::io::stdout().flush()?;
        while !crate::signals::stop_requested() {
            std::thread::sleep(Duration::from_millis(50));
        }
        let grace = Duration::from_secs(args.drain_seconds);
        tracing::info!(
            "stopping: no new requests; answers in work get {grace:?} to finish (a second signal stops at once)"
        );
        let drained = server.drain(grace);
        tracing::info!(
            "stopped: {} answers were in work, {} of them ended by the shutdown",
            drained.in_work,
            drained.cut
        );
        Ok(())
    }
}

/// A run's or checkpoint's folder name, for the API.
fn folder_name(path: &std::path::Path) -> String {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    path.file_name().map_or_else(|| "ember".to_string(), |n| n.to_string_lossy().into_owned())
}
