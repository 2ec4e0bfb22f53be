use std::ops::RangeInclusive;
use std::path::PathBuf;

use anyhow::Context;
use burn::tensor::{DType, Device};
use clap::{Args, Subcommand};
use ember_generate::engine::{Engine, EngineConfig};
use ember_kernels::TrainBackend;
use ember_train::bench::{bench_decode, bench_loss, bench_peak, bench_run, BenchSettings, DecodeBenchSpec, PeakSource};
use ember_train::config::{Precision, Purpose};
use ember_train::flops::Gemms;
use ember_train::{ConfigFile, ResolvedConfig};
use serde::Serialize;

use crate::backend::{dispatch, gpu_name, memory_available, memory_probe, DeviceSpec, Job};
use crate::commands::source::ModelSource;

mod target;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Time the training step of a config: step time, tokens/s, MFU, peak memory.
    Train(TrainBenchArgs),
    /// The best square-GEMM rate of the backend: the peak MFU is measured against on the CPU.
    Peak(PeakBenchArgs),
    /// Memory and time of the LM head + loss, plain against tiled (forward and backward).
    Loss(LossBenchArgs),
    /// The CPU's causal attention kernels, forward and backward, with f32 and with bf16 products.
    Attention(AttentionBenchArgs),
    /// Decode speed with and without the KV cache as the context grows.
    Decode(DecodeBenchArgs),
    /// Prompt processing speed as the prompt grows: one prefill pass a prompt, its milliseconds a
    /// token by part, peak RSS.
    Prefill(PrefillBenchArgs),
    /// How long `ember dashboard` takes to load a log directory of many long runs.
    Dashboard(DashboardBenchArgs),
    /// Concurrent streaming clients against `ember serve` (started in-process on a free port):
    /// aggregate tokens/s, time to first token, time between tokens.
    Serve(ServeBenchArgs),
    /// Train a config until its val loss first reaches --target-val: time to target, steps, tokens,
    /// the val curve (exit status 2 when it is not reached within --max-steps).
    Target(target::TargetBenchArgs),
    /// Bus bandwidth of ember's gradient reduction against the engine's own all-reduce
    /// (`mpirun -n N ember bench allreduce`).
    Allreduce(AllreduceBenchArgs),
}

#[derive(Args, Debug)]
struct AllreduceBenchArgs {
    /// Message sizes in bytes, each in 4..=4294967296 (4 GiB; a rank holds about eight buffers of
    /// the size).
    #[arg(long, value_delimiter = ',', default_value = "4096,65536,1048576,16777216,67108864,268435456")]
    sizes: Vec<usize>,
    /// Timed repetitions per size (the median is reported), 1..=1000.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Gradient bucket size in MiB, as `[distributed] bucket_mib`, 1..=16384.
    #[arg(long, default_value_t = 25)]
    bucket_mib: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct AttentionBenchArgs {
    /// Sequences, 1..=4096. With the other sizes, q/k/v and their gradients must fit in 8 GiB.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Positions a sequence, 1..=1048576.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Query heads, 1..=1024, a multiple of --kv-heads.
    #[arg(long, default_value_t = 9)]
    heads: usize,
    /// Key/value heads, 1..=1024.
    #[arg(long, default_value_t = 3)]
    kv_heads: usize,
    /// Head size, 1..=1024.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Runs of each (f32 and bf16 alternating), 1..=1000; the best is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct DashboardBenchArgs {
    /// Runs written to a scratch log directory, 1..=1000.
    #[arg(long, default_value_t = 100)]
    runs: usize,
    /// Records each run, 1..=1000000; --runs × --steps at most 10000000 (about 2.3 GB of
    /// metrics.jsonl).
    #[arg(long, default_value_t = 10_000)]
    steps: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct DecodeBenchArgs {
    /// A run directory or checkpoint folder, `gguf:FILE` (its stored quantized weights) or `hf:DIR`.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Context lengths (prompt tokens) to measure at, each at least 1 and leaving room for
    /// --new-tokens and --uncached-tokens within the model's max_seq_len.
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512,1024")]
    contexts: Vec<usize>,
    /// Tokens generated with the cache at each context, 1..=1048576 (and within max_seq_len).
    #[arg(long, default_value_t = 32)]
    new_tokens: usize,
    /// Tokens generated without the cache at each context, 0..=1048576 (0: no uncached timing).
    #[arg(long, default_value_t = 4)]
    uncached_tokens: usize,
    #[command(flatten)]
    cache: CacheArgs,
}

/// The flags a decode and a prefill bench share after their own: the KV cache's blocks, the
/// sequences side by side, the device and `--json`.
#[derive(Args, Debug)]
struct CacheArgs {
    /// Positions per KV-cache block, 1..=65536. The cache of every sequence must fit in the
    /// device's memory.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Sequences decoded side by side (each step feeds one token of every one), 1..=256.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[command(flatten)]
    kv_cache: super::KvCacheFlag,
    #[command(flatten)]
    common: Common,
}

/// The prefill bench's flags: [`CacheArgs`], two of them worded for prompts.
#[derive(Args, Debug)]
#[command(
    mut_arg("block_size", |a| a.help("Positions per KV-cache block, 1..=65536")),
    mut_arg("batch", |a| a.help("Prompts processed side by side, 1..=256"))
)]
struct PrefillBenchArgs {
    /// A run directory or checkpoint folder, `gguf:FILE` (its stored quantized weights) or `hf:DIR`.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Prompt lengths to measure, each at least 1 and less than the model's max_seq_len.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    contexts: Vec<usize>,
    #[command(flatten)]
    cache: CacheArgs,
}

#[derive(Args, Debug)]
struct ServeBenchArgs {
    /// A run directory or checkpoint folder, `gguf:FILE` (its stored quantized weights) or `hf:DIR`.
    #[arg(long)]
    checkpoint: PathBuf,
    #[command(flatten)]
    kv_cache: super::KvCacheFlag,
    /// Numbers of concurrent clients to measure, each in 1..=256 (the server gets as many slots as
    /// the largest).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    clients: Vec<usize>,
    /// Requests each client sends, one after the other, 1..=10000.
    #[arg(long, default_value_t = 2)]
    requests: usize,
    /// Tokens each answer streams (the end-of-text token is ignored, as vLLM's `ignore_eos`),
    /// 1..=1048576 and at most the model's max_seq_len.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    /// A system prompt every request opens with (text, or @FILE), each client's requests then
    /// asking `Question C: PROMPT`: the load of a chat front end whose requests share a prefix.
    #[arg(long)]
    system: Option<String>,
    /// Prefill every prompt in full (the server's `--no-prefix-sharing`).
    #[arg(long)]
    no_prefix_sharing: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct Common {
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct TrainBenchArgs {
    #[arg(long)]
    config: PathBuf,
    /// Timed steps (the median is reported), 1..=10000.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Untimed steps first, 0..=10000.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// f32, bf16 or f16 (overrides train.precision).
    #[arg(long)]
    precision: Option<Precision>,
    /// Peak TFLOP/s for MFU (instead of the table or a measured GEMM peak), finite, above 0 and at
    /// most 1000000.
    #[arg(long)]
    peak_tflops: Option<f64>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct PeakBenchArgs {
    /// GEMM dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: Precision,
    /// Square sizes to try, each in 1..=32768; three n×n matrices of the largest (16·n² bytes
    /// counted) must fit in the device's memory.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
    sizes: Vec<usize>,
    /// Timed repetitions per size (the fastest is kept), 1..=1000.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct LossBenchArgs {
    /// Rows (B·T), 1..=16777216. The plain loss holds three [tokens, vocab] f32 tensors: with the
    /// inputs and their gradients they must fit in the device's memory.
    #[arg(long, default_value_t = 8192)]
    tokens: usize,
    /// Model width, 1..=65536.
    #[arg(long, default_value_t = 512)]
    d_model: usize,
    /// Vocabulary (Llama 3: 128,256), 1..=16777216.
    #[arg(long, default_value_t = 128_256)]
    vocab: usize,
    #[command(flatten)]
    common: Common,
}

/// Runs a benchmark closure on the chosen backend.
struct BenchJob<F>(F);

trait BenchFn {
    type Out: Serialize;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out>;
}

impl<F: BenchFn> Job for BenchJob<F> {
    type Output = F::Out;
    fn run<B: TrainBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<F::Out> {
        self.0.call::<B>(&device, name)
    }
}

struct TrainBenchFn(TrainBenchArgs, ResolvedConfig);
impl BenchFn for TrainBenchFn {
    type Out = ember_train::bench::TrainBench;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out> {
        let a = &self.0;
        let settings = BenchSettings {
            warmup: a.warmup,
            steps: a.steps,
            peak: PeakSource { device_name: gpu_name(a.common.device), peak_tflops: a.peak_tflops },
            compute: crate::env::compute_request(),
        };
        let probe = memory_probe(a.common.device);
        Ok(bench_run::<B>(self.1, &crate::env::locations(), &settings, device, name, probe)?)
    }
}

struct PeakBenchFn(PeakBenchArgs);
impl BenchFn for PeakBenchFn {
    type Out = ember_train::bench::PeakBench;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out> {
        let a = &self.0;
        let cache = crate::env::cache_dir();
        // The CPU runs `--precision bf16` on its bf16 kernel (f32 tensors): that is the rate to know.
        let dtype = a.dtype.dtype();
        let cpu = crate::env::compute().cpu;
        let cpu_bf16 = cpu.bf16.filter(|_| dtype == DType::BF16 && B::cpu_bf16_gemms());
        let gemms = cpu_bf16.map_or(Gemms::Backend(dtype), Gemms::CpuBf16);
        let peak = bench_peak::<B::InnerBackend>(device, name, gemms, &a.sizes, a.reps, Some(&cache));
        // Where `--precision bf16` has kernels to choose from: which one each class of products
        // runs on, measured again, and cached for the runs that follow.
        if !B::cpu_bf16_gemms() || cpu.bf16.is_none() {
            return Ok(peak);
        }
        let file = ember_train::calibration::cache_file(&cache);
        Ok(peak.with_kernels(ember_train::calibration::measure(cpu, Some(file))))
    }
}

struct LossBenchFn(LossBenchArgs);
impl BenchFn for LossBenchFn {
    type Out = ember_train::bench::LossBench;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out> {
        let a = &self.0;
        let compute = crate::env::compute();
        Ok(bench_loss::<B>(device, name, a.tokens, a.d_model, a.vocab, compute, memory_probe(a.common.device)))
    }
}

struct DecodeBenchFn(DecodeBenchArgs, ModelSource);
impl BenchFn for DecodeBenchFn {
    type Out = ember_train::bench::DecodeBench;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out> {
        let a = &self.0;
        let compute = a.cache.kv_cache.apply(crate::env::compute());
        let model = self.1.decoder::<B::InnerBackend>(device)?.with_compute(compute);
        let spec = DecodeBenchSpec {
            contexts: a.contexts.clone(),
            new_tokens: a.new_tokens,
            uncached_tokens: a.uncached_tokens,
            block_size: a.cache.block_size,
            batch: a.cache.batch,
        };
        Ok(bench_decode(&model, name, &spec))
    }
}

/// A decode bench of one step a context, shown as what it measured of the prompts.
struct PrefillBenchFn(DecodeBenchFn);
impl BenchFn for PrefillBenchFn {
    type Out = ember_train::bench::PrefillBench;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out> {
        Ok(ember_train::bench::PrefillBench(self.0.call::<B>(device, name)?))
    }
}

struct ServeBenchFn(ServeBenchArgs, ModelSource);
impl BenchFn for ServeBenchFn {
    type Out = ServeBench;
    fn call<B: TrainBackend>(self, device: &Device<B>, name: &str) -> anyhow::Result<Self::Out> {
        let (a, checkpoint) = (self.0, self.1);
        let compute = a.kv_cache.apply(crate::env::compute());
        let model = checkpoint.decoder::<B::InnerBackend>(device)?.with_compute(compute);
        let (context, vocab_size) = (model.config().max_seq_len, model.config().vocab_size);
        let slots = a.clients.iter().copied().max().unwrap_or(1);
        let share_prefixes = !a.no_prefix_sharing;
        let engine =
            Engine::new(model, EngineConfig { slots, queue_limit: 4096, share_prefixes, ..EngineConfig::default() });
        let system = match a.system.as_deref() {
            Some(s) => Some(match s.strip_prefix('@') {
                Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading --system {path}"))?,
                None => s.to_string(),
            }),
            None => None,
        };
        let prompt = |c: usize, _: usize| match &system {
            Some(system) => format!("{system}\n\nQuestion {c}: {}", a.prompt),
            None => a.prompt.clone(),
        };
        let options = ember_serve::Options {
            model_name: "bench".into(),
            tokenizer: checkpoint.tokenizer.clone(),
            template: None,
            context,
            vocab_size,
            // The bench's requests set their own sampling.
            sampling: ember_serve::sampling::ChatDefaults::built_in().sampling,
            allowed_hosts: Vec::new(),
            api_key: None,
            limits: ember_serve::Limits::default(),
        };
        let server =
            ember_serve::Server::start(([127, 0, 0, 1], 0).into(), ember_serve::Worker::spawn(engine)?, options)?;
        let base = format!("http://{}", server.addr());
        // One short request first: the first forward passes pay for allocations the others reuse.
        ember_serve::bench::load(&base, 1, 1, &|_, _| a.prompt.clone(), 4)?;
        let loads = a
            .clients
            .iter()
            .map(|&n| ember_serve::bench::load(&base, n, a.requests, &prompt, a.max_tokens))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ServeBench { device: name.to_string(), slots, max_tokens: a.max_tokens, loads })
    }
}

#[derive(Debug, Serialize)]
struct ServeBench {
    device: String,
    slots: usize,
    max_tokens: usize,
    loads: Vec<ember_serve::bench::Load>,
}

impl std::fmt::Display for ServeBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "ember serve on {}, {} slots, {} tokens an answer:", self.device, self.slots, self.max_tokens)?;
        for l in &self.loads {
            writeln!(f, "  {l}")?;
        }
        if let Some(one) = self.loads.iter().find(|l| l.clients == 1) {
            let ratios: Vec<String> = (self.loads.iter().filter(|l| l.clients > 1))
                .map(|l| format!("{}: {:.2}x", l.clients, l.tokens_per_s / one.tokens_per_s))
                .collect();
            write!(f, "  aggregate over 1 client's: {}", ratios.join(", "))?;
        }
        Ok(())
    }
}

fn report<T: Serialize + std::fmt::Display>(json: bool, value: &T) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(value)?);
    } else {
        println!("{value}");
    }
    Ok(())
}

pub fn run(
    args: BenchArgs,
    collective: std::sync::Arc<dyn ember_train::distributed::Collective>,
) -> anyhow::Result<()> {
    match args.what {
        BenchCommand::Train(a) => train(a),
        BenchCommand::Peak(a) => peak(a),
        BenchCommand::Loss(a) => loss(a),
        BenchCommand::Attention(a) => attention(a),
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Prefill(a) => prefill(a),
        BenchCommand::Dashboard(a) => dashboard(a),
        BenchCommand::Serve(a) => serve(a),
        BenchCommand::Allreduce(a) => allreduce(a, collective.as_ref()),
        BenchCommand::Target(a) => target::target(a),
    }
}

/// Refuses `value` of `flag` outside `range`, naming both: `--steps 0 is not in 1..=10000`.
fn in_range(flag: &str, value: usize, range: RangeInclusive<usize>) -> anyhow::Result<()> {
    anyhow::ensure!(range.contains(&value), "{flag} {value} is not in {}..={}", range.start(), range.end());
    Ok(())
}

/// [`in_range`] for every value of a list flag, which must not be empty.
fn each_in_range(flag: &str, values: &[usize], range: RangeInclusive<usize>) -> anyhow::Result<()> {
    anyhow::ensure!(!values.is_empty(), "{flag} is empty: give at least one value");
    values.iter().try_for_each(|&v| in_range(flag, v, range.clone()))
}

/// The memory a benchmark may take where the device's is unknown (WGPU).
const UNKNOWN_MEMORY_CEILING: u64 = 64 << 30;

/// Refuses a benchmark that needs `need` bytes (`None`: past 2^64) when the device has less free
/// (or, where that is unknown, more than [`UNKNOWN_MEMORY_CEILING`]); `what` names the flags and
/// their values, as `--sizes 100000`.
fn fits_memory(what: &str, need: Option<u64>, device: DeviceSpec) -> anyhow::Result<()> {
    let (limit, of) = match memory_available(device) {
        Some(free) => (free, "of memory available"),
        None => (UNKNOWN_MEMORY_CEILING, "this benchmark takes where the device's memory is unknown"),
    };
    if need.is_some_and(|n| n <= limit) {
        return Ok(());
    }
    let need = need.map_or("more than 2^64 bytes".to_string(), ember_train::memory::gib);
    anyhow::bail!("{what} needs {need}, more than the {} {of}", ember_train::memory::gib(limit))
}

/// `a · b · …` in u64, `None` past 2^64.
fn product(factors: &[usize]) -> Option<u64> {
    factors.iter().try_fold(1u64, |acc, &f| acc.checked_mul(f as u64))
}

fn train(mut a: TrainBenchArgs) -> anyhow::Result<()> {
    in_range("--steps", a.steps, 1..=10_000)?;
    in_range("--warmup", a.warmup, 0..=10_000)?;
    if let Some(t) = a.peak_tflops {
        anyhow::ensure!(t.is_finite() && t > 0.0 && t <= 1e6, "--peak-tflops {t} is not in (0, 1000000]");
    }
    let mut run = ConfigFile::read_for(&a.config, Purpose::Bench)?.resolve()?;
    if let Some(p) = a.precision.take() {
        run.config.train.precision = p;
    }
    let (device, json, ckpt) = (a.common.device, a.common.json, run.config.train.activation_checkpointing);
    report(json, &dispatch(device, ckpt, BenchJob(TrainBenchFn(a, run)))?)
}

fn peak(a: PeakBenchArgs) -> anyhow::Result<()> {
    each_in_range("--sizes", &a.sizes, 1..=32_768)?;
    in_range("--reps", a.reps, 1..=1000)?;
    // Two operands and the product, and a dtype cast of each operand: 16·n² bytes is an upper bound.
    let n = a.sizes.iter().copied().max().unwrap_or(1);
    fits_memory(&format!("--sizes {n}"), product(&[16, n, n]), a.common.device)?;
    let (device, json) = (a.common.device, a.common.json);
    report(json, &dispatch(device, false, BenchJob(PeakBenchFn(a)))?)
}

fn loss(a: LossBenchArgs) -> anyhow::Result<()> {
    in_range("--tokens", a.tokens, 1..=1 << 24)?;
    in_range("--d-model", a.d_model, 1..=1 << 16)?;
    in_range("--vocab", a.vocab, 1..=1 << 24)?;
    // The plain loss: logits, their softmax and gradient ([N, V] each), the inputs and their
    // gradients ([N, D] and [D, V] twice), all f32 (its measured peak: 12.6 GB for the defaults).
    let (n, d, v) = (a.tokens, a.d_model, a.vocab);
    let need = [product(&[3, n, v]), product(&[2, n, d]), product(&[2, d, v])]
        .into_iter()
        .try_fold(0u64, |acc, t| acc.checked_add(t?))
        .and_then(|elems| elems.checked_mul(4));
    fits_memory(&format!("--tokens {n} --d-model {d} --vocab {v}"), need, a.common.device)?;
    let (device, json) = (a.common.device, a.common.json);
    report(json, &dispatch(device, false, BenchJob(LossBenchFn(a)))?)
}

fn prefill(a: PrefillBenchArgs) -> anyhow::Result<()> {
    let decode = DecodeBenchArgs {
        checkpoint: a.checkpoint,
        contexts: a.contexts,
        new_tokens: 1,
        uncached_tokens: 0,
        cache: a.cache,
    };
    let (checkpoint, device, json) = decode_checks(&decode)?;
    report(json, &dispatch(device, false, BenchJob(PrefillBenchFn(DecodeBenchFn(decode, checkpoint))))?)
}

fn decode(a: DecodeBenchArgs) -> anyhow::Result<()> {
    let (checkpoint, device, json) = decode_checks(&a)?;
    report(json, &dispatch(device, false, BenchJob(DecodeBenchFn(a, checkpoint)))?)
}

/// The flags of a decode (or prefill) bench checked, the checkpoint opened and the bounds its model
/// sets checked: the model source, the device and `--json`.
fn decode_checks(a: &DecodeBenchArgs) -> anyhow::Result<(ModelSource, DeviceSpec, bool)> {
    // Every flag first, before the checkpoint is read; then what the model bounds.
    each_in_range("--contexts", &a.contexts, 1..=1 << 24)?;
    in_range("--new-tokens", a.new_tokens, 1..=1 << 20)?;
    in_range("--uncached-tokens", a.uncached_tokens, 0..=1 << 20)?;
    let (block_size, batch, common) = (a.cache.block_size, a.cache.batch, &a.cache.common);
    in_range("--block-size", block_size, 1..=1 << 16)?;
    in_range("--batch", batch, 1..=256)?;
    let checkpoint = ModelSource::open(&a.checkpoint)?;
    let config = &checkpoint.model_config;
    let max = config.max_seq_len;
    let longest = a.new_tokens.max(a.uncached_tokens);
    if let Some(c) = a.contexts.iter().find(|&&c| c.saturating_add(longest) > max) {
        anyhow::bail!("--contexts {c} plus {longest} generated tokens does not fit the model's max_seq_len of {max}");
    }
    // The KV cache of the longest context: whole blocks for every sequence, keys and values of
    // every layer in f32, twice over while the pool grows.
    let positions = a.contexts.iter().max().map_or(0, |c| c + longest).div_ceil(block_size) * block_size;
    // Latent attention caches one latent and rotary key a layer, not every head's keys and values.
    let per_layer = match &config.mla {
        Some(mla) => &[mla.cache_width()][..],
        None => &[2, config.n_kv_heads(), config.head_dim()][..],
    };
    let per_position = product(&[per_layer, &[config.n_layers, 4]].concat());
    let need = per_position.and_then(|p| p.checked_mul(product(&[2, batch, positions])?));
    let what = format!("--block-size {block_size} --batch {batch} (KV cache of {positions} positions)");
    fits_memory(&what, need, common.device)?;
    Ok((checkpoint, common.device, common.json))
}

fn serve(a: ServeBenchArgs) -> anyhow::Result<()> {
    each_in_range("--clients", &a.clients, 1..=256)?;
    in_range("--requests", a.requests, 1..=10_000)?;
    in_range("--max-tokens", a.max_tokens, 1..=1 << 20)?;
    let checkpoint = ModelSource::open(&a.checkpoint)?;
    in_range("--max-tokens", a.max_tokens, 1..=checkpoint.model_config.max_seq_len)?;
    let (device, json) = (a.common.device, a.common.json);
    report(json, &dispatch(device, false, BenchJob(ServeBenchFn(a, checkpoint)))?)
}

fn attention(a: AttentionBenchArgs) -> anyhow::Result<()> {
    in_range("--batch", a.batch, 1..=4096)?;
    in_range("--heads", a.heads, 1..=1024)?;
    in_range("--kv-heads", a.kv_heads, 1..=1024)?;
    in_range("--head-dim", a.head_dim, 1..=1024)?;
    in_range("--reps", a.reps, 1..=1000)?;
    anyhow::ensure!(
        a.heads.is_multiple_of(a.kv_heads),
        "--heads {} is not a multiple of --kv-heads {}",
        a.heads,
        a.kv_heads
    );
    // q/k/v, the output, its gradient and q/k/v's gradient: about three q/k/v's worth of f32.
    let bytes = product(&[a.heads + 2 * a.kv_heads, a.head_dim, a.batch, a.seq, 12]);
    const LIMIT: u64 = 8 << 30;
    anyhow::ensure!(
        bytes.is_some_and(|b| b <= LIMIT),
        "--batch {} --seq {} --heads {} --kv-heads {} --head-dim {} needs more than the 8 GiB this benchmark allows",
        a.batch,
        a.seq,
        a.heads,
        a.kv_heads,
        a.head_dim
    );
    // After the memory: a shape past 8 GiB is refused as such, whatever its length.
    in_range("--seq", a.seq, 1..=1 << 20)?;
    let shape = (a.batch, a.seq, a.heads, a.kv_heads, a.head_dim);
    let r = ember_train::bench::bench_attention(crate::env::compute().cpu, shape, a.reps);
    report(a.json, &r)
}

fn dashboard(a: DashboardBenchArgs) -> anyhow::Result<()> {
    in_range("--runs", a.runs, 1..=1000)?;
    in_range("--steps", a.steps, 1..=1_000_000)?;
    in_range("--runs × --steps", a.runs * a.steps, 1..=10_000_000)?;
    let dir = tempfile::tempdir().context("creating a scratch log directory")?;
    let r = ember_dashboard::bench::load(dir.path(), a.runs, a.steps)?;
    report(a.json, &r)
}

fn allreduce(a: AllreduceBenchArgs, c: &dyn ember_train::distributed::Collective) -> anyhow::Result<()> {
    // Fixed bounds, not the free memory: every rank must come to the same answer.
    each_in_range("--sizes", &a.sizes, 4..=1 << 32)?;
    in_range("--reps", a.reps, 1..=1000)?;
    in_range("--bucket-mib", a.bucket_mib, 1..=16384)?;
    let r = ember_train::distributed::bench::bench_allreduce(c, &a.sizes, a.reps, a.bucket_mib)?;
    // Every rank measured; rank 0 reports.
    if c.rank() == 0 {
        report(a.json, &r)?;
    }
    Ok(())
}

impl BenchArgs {
    /// Whether this benchmark runs a server whose engine enters the CPU kernels' pool on a thread of
    /// its own (the caller must then not hold a worker of the pool while it waits).
    pub fn serves(&self) -> bool {
        matches!(self.what, BenchCommand::Serve(_))
    }
}
