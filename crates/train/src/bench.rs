//! Benchmarks: the training step (`ember bench train`), the GEMM peak (`ember bench peak`), and the
//! memory of the LM head + loss (`ember bench loss`).

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
use ember_data::fetch::Locations;
use ember_data::WindowSampler;
use ember_kernels::cross_entropy::lm_head_loss_reference;
use ember_kernels::{lm_head_cross_entropy, ChunkSpec, Compute, Cpu, TrainBackend};
use ember_model::Decoder;
use serde::Serialize;

use crate::error::TrainError;
use crate::flops::{mfu, resolve_peak, GemmRate, Gemms};
use crate::init::ResolvedConfig;
use crate::optim::AdamW;
use crate::precision::LossScaler;
use crate::precision::{peak_gemms, precision_label, run_compute, ComputeRequest};
use crate::schedule::LrSchedule;
use crate::step::{Optimizer, Stepper};
use crate::trainer::{initial_model, prepare};

pub use crate::memory::{MemoryProbe, NoProbe};

#[derive(Debug, Clone, Serialize)]
pub struct TrainBench {
    pub device: String,
    pub precision: String,
    pub activation_checkpointing: bool,
    pub steps: usize,
    /// Median wall time of one optimizer step (forward, backward, clipping, AdamW), milliseconds.
    pub step_ms: f64,
    pub step_ms_min: f64,
    pub step_ms_max: f64,
    pub tokens_per_step: usize,
    /// Tokens per second at the median step time.
    pub tokens_per_sec: f64,
    /// Training FLOPs per token, 6N + 12·L·T·d.
    pub flops_per_token: f64,
    pub peak_flops: f64,
    pub peak_source: String,
    /// flops_per_token · tokens_per_sec / peak_flops, at most 1.
    pub mfu: f64,
    /// Highest memory in use during the timed steps (model, optimizer state, activations, data).
    pub peak_memory_bytes: Option<u64>,
}

/// Where the device's peak comes from, as for training.
#[derive(Debug, Clone, Default)]
pub struct PeakSource {
    pub device_name: Option<String>,
    pub peak_tflops: Option<f64>,
}

/// How a training benchmark runs: `steps` timed optimizer steps after `warmup` untimed ones.
#[derive(Debug, Clone, Default)]
pub struct BenchSettings {
    pub warmup: usize,
    pub steps: usize,
    pub peak: PeakSource,
    pub compute: ComputeRequest,
}

/// Times the steps of a run whose `init_from` source is open (`TrainConfig::resolve` or
/// `ConfigFile::resolve`), as `settings` says.
pub fn bench_run<B: TrainBackend>(
    run: ResolvedConfig,
    locations: &Locations,
    settings: &BenchSettings,
    device: &Device<B>,
    device_label: &str,
    probe: &dyn MemoryProbe,
) -> Result<TrainBench, TrainError> {
    let (warmup, steps) = (settings.warmup, settings.steps);
    let setup = prepare(run, locations, 1)?;
    let config = &setup.config;
    let compute = run_compute::<B>(device, config, settings.compute, Some(locations.cache_dir.as_path()));
    let peak = resolve_peak::<B::InnerBackend>(
        device,
        settings.peak.device_name.as_deref(),
        peak_gemms(&compute),
        settings.peak.peak_tflops,
        Some(locations.cache_dir.as_path()),
    );
    // The model a run of this config trains: `init_from`'s weights and LoRA adapters included.
    let mut model = initial_model::<B>(&setup, device)?.with_compute(compute);
    let mut optim = Optimizer::Replicated(
        AdamW::<B>::new(config.optim.clone(), compute).with_muon(config.muon.as_ref(), config.schedule.lr),
    );
    let mut scaler = (compute.dtype == DType::F16).then(LossScaler::default);
    let schedule = LrSchedule::from_config(config);
    let splits = crate::objective::Splits { train: &setup.train, val: &setup.val };
    let objective = crate::objective::build_timed::<B>(config, splits)?;
    let stepper = Stepper {
        data: &setup.train,
        sampler: WindowSampler::random(config.train.seed),
        config,
        objective: objective.as_ref(),
        device,
        collective: &crate::distributed::Solo,
        buffers: Default::default(),
        device_comm: None,
    };
    let accum = stepper.micro_batches_per_step();
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        if i == warmup {
            let _ = B::sync(device);
            probe.reset_peak();
        }
        let start = Instant::now();
        let stream = i as u64 * accum;
        let lr = schedule.lr(i);
        (model, _) = stepper.step(model, &mut optim, stream, i + 1, lr, scaler.as_mut())?;
        let _ = B::sync(device);
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let step_ms = times[times.len() / 2];
    let tokens_per_step = config.tokens_per_step();
    let tokens_per_sec = tokens_per_step as f64 / (step_ms / 1e3);
    let flops_per_token = config.train_flops_per_token();
    let rate = flops_per_token * tokens_per_sec;
    if rate > peak.flops {
        let again = if peak.remeasurable { "; `ember bench peak` measures it again" } else { "" };
        tracing::warn!(
            "{:.4} TFLOP/s of model FLOPs, above the peak of {:.4} TFLOP/s ({}): MFU is reported as 100 %{again}",
            rate / 1e12,
            peak.flops / 1e12,
            peak.source
        );
    }
    Ok(TrainBench {
        device: device_label.to_string(),
        precision: precision_label(&compute),
        activation_checkpointing: config.train.activation_checkpointing,
        steps,
        step_ms,
        step_ms_min: times[0],
        step_ms_max: times[times.len() - 1],
        tokens_per_step,
        tokens_per_sec,
        flops_per_token,
        peak_flops: peak.flops,
        peak_source: peak.source.clone(),
        mfu: mfu(flops_per_token, tokens_per_sec, &peak),
        peak_memory_bytes: probe.peak_bytes(),
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct PeakBench {
    pub device: String,
    pub dtype: String,
    pub gemms: Vec<GemmRate>,
    /// The best rate: the peak MFU is measured against on this device.
    pub peak_flops: f64,
    /// On a CPU with bf16 kernels: each class of `--precision bf16` products timed on every
    /// kernel, and the one chosen (measured again and cached by `ember bench peak`).
    pub kernels: Option<KernelTable>,
}

/// This CPU's calibration ([`crate::calibration`]) as `ember bench peak` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct KernelTable {
    pub calibration: ember_kernels::calibrate::Calibration,
    /// The kernel each class runs on under `--precision bf16` (`f32`, `AVX512_BF16`, `AMX tiles`),
    /// class by class.
    pub chosen: Vec<(ember_kernels::calibrate::Class, &'static str)>,
    /// Where it is cached for runs to read.
    pub file: Option<PathBuf>,
}

impl PeakBench {
    /// With this CPU's calibration, measured now.
    pub fn with_kernels(self, measured: crate::calibration::Measured) -> Self {
        use crate::calibration::kernel_name;
        use ember_kernels::calibrate::Class;
        let c = measured.calibration;
        let chosen = Class::ALL.into_iter().map(|class| (class, kernel_name(c.choice(class)))).collect();
        Self { kernels: Some(KernelTable { calibration: c, chosen, file: measured.file }), ..self }
    }
}

/// The best square-GEMM rate the backend (or the CPU's bf16 kernel) reaches, remembered in `cache`
/// for MFU.
pub fn bench_peak<B: Backend>(
    device: &Device<B>,
    device_label: &str,
    which: Gemms,
    sizes: &[usize],
    reps: usize,
    cache: Option<&std::path::Path>,
) -> PeakBench {
    let gemms = which.measure::<B>(device, sizes, reps);
    let peak_flops = gemms.iter().map(|g| g.flops).filter(|f| f.is_finite()).fold(0.0, f64::max);
    // A peak of 0 (or none at all) would put every later run's MFU at inf %: only a real rate is
    // remembered.
    if let Some(dir) = cache.filter(|_| peak_flops > 0.0) {
        let file = dir.join(crate::flops::peak_cache_name::<B>(device, which));
        crate::flops::store_peak(&file, peak_flops, crate::flops::now_unix());
    }
    let dtype = match which {
        Gemms::Backend(dtype) => format!("{dtype:?}").to_lowercase(),
        Gemms::CpuBf16(kernel) => format!("bf16 ({} kernel, f32 sums)", kernel.name()),
    };
    PeakBench { device: device_label.to_string(), dtype, gemms, peak_flops, kernels: None }
}

/// Forward and backward times of the CPU's causal attention kernels on one shape, with f32 and with
/// bf16 products (`--precision bf16` on a CPU with AVX512_BF16, over 256 positions): the best of the
/// repetitions, the two alternating.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionBench {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub reps: usize,
    pub f32_forward_ms: f64,
    pub f32_backward_ms: f64,
    /// `None` where the CPU lacks AVX512_BF16.
    pub bf16_forward_ms: Option<f64>,
    pub bf16_backward_ms: Option<f64>,
    /// The largest `|o_bf16 − o_f32|` over the largest `|o_f32|`.
    pub bf16_output_error: Option<f64>,
}

/// Times the CPU's attention kernels and their backward on random q/k/v of `shape` (batch,
/// positions, heads, key/value heads, head size) on `cpu` ([`ember_kernels::bench::attention`]):
/// `reps` runs each, f32 and bf16 alternating, the best kept.
pub fn bench_attention(cpu: Cpu, shape: (usize, usize, usize, usize, usize), reps: usize) -> AttentionBench {
    let (batch, seq, heads, kv_heads, head_dim) = shape;
    let t = ember_kernels::bench::attention(cpu, shape, reps);
    AttentionBench {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
        reps,
        f32_forward_ms: t.f32_ms.0,
        f32_backward_ms: t.f32_ms.1,
        bf16_forward_ms: t.bf16_ms.map(|(fw, _)| fw),
        bf16_backward_ms: t.bf16_ms.map(|(_, bw)| bw),
        bf16_output_error: t.bf16_output_error,
    }
}

impl std::fmt::Display for AttentionBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "attention B {} T {} heads {}/{} of {} (best of {}): f32 forward {:.2} ms, backward {:.2} ms",
            self.batch,
            self.seq,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.reps,
            self.f32_forward_ms,
            self.f32_backward_ms
        )?;
        match (self.bf16_forward_ms, self.bf16_backward_ms) {
            (Some(fw), Some(bw)) => write!(
                f,
                "; bf16 products forward {fw:.2} ms, backward {bw:.2} ms ({:.2}x f32), output within {:.1e} of f32",
                (self.f32_forward_ms + self.f32_backward_ms) / (fw + bw),
                self.bf16_output_error.unwrap_or(f64::NAN)
            ),
            _ => write!(f, "; no AVX512_BF16 on this CPU: no bf16 products"),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LossBench {
    pub device: String,
    pub tokens: usize,
    pub d_model: usize,
    pub vocab_size: usize,
    pub tile_rows: usize,
    pub tile_vocab: usize,
    /// Highest memory above the inputs during forward + backward of the plain LM head + loss.
    pub plain_peak_bytes: Option<u64>,
    pub chunked_peak_bytes: Option<u64>,
    pub plain_ms: f64,
    pub chunked_ms: f64,
    /// |loss_chunked - loss_plain|.
    pub loss_diff: f64,
}

/// Forward and backward of the LM head + loss on random `[tokens, d]` hidden states and a `[d, V]`
/// head, plain and tiled, measuring time and the memory above the inputs.
pub fn bench_loss<B: AutodiffBackend + TrainBackend>(
    device: &Device<B>,
    device_label: &str,
    tokens: usize,
    d_model: usize,
    vocab_size: usize,
    compute: Compute,
    probe: &dyn MemoryProbe,
) -> LossBench {
    let spec = ChunkSpec::auto(tokens, vocab_size, compute.with_dtype(DType::F32));
    let targets: Vec<i32> = (0..tokens).map(|i| ((i as u64 * 2_654_435_761) % vocab_size as u64) as i32).collect();
    let h0 = Tensor::<B::InnerBackend, 2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), device);
    let w0 = Tensor::<B::InnerBackend, 2>::random([d_model, vocab_size], Distribution::Normal(0.0, 0.02), device);
    let run = |chunked: bool| {
        let _ = B::sync(device);
        let base = probe.current_bytes();
        probe.reset_peak();
        let start = Instant::now();
        let h = Tensor::<B, 2>::from_inner(h0.clone()).require_grad();
        let w = Tensor::<B, 2>::from_inner(w0.clone()).require_grad();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [tokens]), device);
        let loss = if chunked {
            lm_head_cross_entropy(h.clone(), w.clone(), t, spec)
        } else {
            lm_head_loss_reference(h.clone(), w.clone(), t, DType::F32)
        };
        let grads = loss.backward();
        let (dh, dw) = (h.grad(&grads), w.grad(&grads));
        let value = loss.into_scalar();
        let _ = B::sync(device);
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let peak = probe.peak_bytes().zip(base).map(|(p, b)| p.saturating_sub(b));
        drop((dh, dw, grads));
        (peak, ms, burn::tensor::ElementConversion::elem::<f64>(value))
    };
    let (chunked_peak_bytes, chunked_ms, chunked_loss) = run(true);
    let (plain_peak_bytes, plain_ms, plain_loss) = run(false);
    LossBench {
        device: device_label.to_string(),
        tokens,
        d_model,
        vocab_size,
        tile_rows: spec.rows,
        tile_vocab: spec.vocab,
        plain_peak_bytes,
        chunked_peak_bytes,
        plain_ms,
        chunked_ms,
        loss_diff: (chunked_loss - plain_loss).abs(),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodeBench {
    pub device: String,
    /// Sequences decoded side by side (one row each per step).
    pub batch: usize,
    pub contexts: Vec<usize>,
    /// Milliseconds per decoding step (one token for every sequence) with the KV cache, at each
    /// context.
    pub cached_ms_per_token: Vec<f64>,
    /// Milliseconds per step recomputing the whole context, at each context.
    pub uncached_ms_per_token: Vec<f64>,
    /// Prompt tokens per second of the prefill pass (all sequences), at each context.
    pub prefill_tokens_per_sec: Vec<f64>,
    /// Cached decode tokens per second, all sequences together, at each context.
    pub decode_tokens_per_sec: Vec<f64>,
    /// KV cache bytes per position (f32).
    pub kv_bytes_per_token: usize,
    /// Where a cached step's milliseconds go, at each context (CPU backends: the ops run as they
    /// are called).
    pub cached_parts_ms: Vec<PartsMs>,
    /// Where the prefill pass's milliseconds go, per prompt token, at each context.
    pub prefill_parts_ms: Vec<PartsMs>,
    /// The process's peak resident memory when the measurements end (Linux's VmHWM), weights,
    /// caches and all.
    pub peak_rss_bytes: Option<u64>,
}

/// A [`DecodeBench`] of one step a context, reported for its prompts (`ember bench prefill`).
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct PrefillBench(pub DecodeBench);

impl std::fmt::Display for PrefillBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = &self.0;
        write!(f, "{} prefill, batch {}:", d.device, d.batch)?;
        for (i, c) in d.contexts.iter().enumerate() {
            write!(f, "\n  prompt {c:>5}: {:.0} tokens/s", d.prefill_tokens_per_sec[i])?;
            if let Some(parts) = d.prefill_parts_ms.get(i) {
                write!(f, "\n    a prompt token: {parts}")?;
            }
        }
        if let Some(b) = d.peak_rss_bytes {
            write!(f, "\n  peak RSS {:.0} MiB", b as f64 / (1u64 << 20) as f64)?;
        }
        Ok(())
    }
}

/// Milliseconds of a forward pass by part ([`ember_kernels::profile`]): the blocks' projections,
/// attention (positions, the cache write and the attention itself), the LM head, and the rest
/// (norms, activations, embedding rows, sampling's argmax, allocation, threads waking).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PartsMs {
    pub projections: f64,
    pub attention: f64,
    pub head: f64,
    pub other: f64,
}

impl PartsMs {
    /// `total_ms` split by the seconds [`ember_kernels::profile::take`] gave, all divided by `per`.
    fn split(total_ms: f64, [p, a, h]: [f64; 3], per: f64) -> Self {
        let (p, a, h) = (p * 1e3, a * 1e3, h * 1e3);
        let per = per.max(1.0);
        Self { projections: p / per, attention: a / per, head: h / per, other: (total_ms - p - a - h).max(0.0) / per }
    }
}

impl std::fmt::Display for PartsMs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "projections {:.2}, attention {:.2}, head {:.2}, other {:.2} ms",
            self.projections, self.attention, self.head, self.other
        )
    }
}

/// The process's peak resident set (Linux: `VmHWM` of /proc/self/status), if known.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// What [`bench_decode`] measures: at each context, `new_tokens` steps with the KV cache and
/// `uncached_tokens` recomputing the window, for `batch` sequences side by side.
#[derive(Debug, Clone)]
pub struct DecodeBenchSpec {
    pub contexts: Vec<usize>,
    pub new_tokens: usize,
    pub uncached_tokens: usize,
    pub block_size: usize,
    pub batch: usize,
}

/// Time per decoding step as the context grows, with and without the KV cache (greedy). The prompt
/// of sequence `b` at context `c` is `c` tokens (different for every sequence).
pub fn bench_decode<B: ember_kernels::EmberBackend>(
    model: &Decoder<B>,
    device_label: &str,
    spec: &DecodeBenchSpec,
) -> DecodeBench {
    let device = model.device();
    let v = model.config().vocab_size;
    let batch = spec.batch.max(1);
    let greedy = |h: Tensor<B, 3>| -> Vec<i32> {
        let [b, t, d] = h.dims();
        let logits = model.logits(h.narrow(1, t - 1, 1).reshape([b, d]));
        let ids = logits.argmax(1).into_data().convert::<i64>();
        ids.as_slice::<i64>().map(|s| s.iter().map(|&i| i as i32).collect()).unwrap_or_default()
    };
    let ids = |n: usize, row: usize| -> Vec<i32> { (0..n).map(|i| ((i * 31 + 7 + row * 101) % v) as i32).collect() };
    let input = |rows: &[Vec<i32>]| {
        let t = rows.first().map_or(0, Vec::len);
        let flat: Vec<i32> = rows.iter().flatten().copied().collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [rows.len(), t]), &device)
    };
    let mut out = DecodeBench {
        device: device_label.to_string(),
        batch,
        contexts: spec.contexts.clone(),
        cached_ms_per_token: Vec::new(),
        uncached_ms_per_token: Vec::new(),
        prefill_tokens_per_sec: Vec::new(),
        decode_tokens_per_sec: Vec::new(),
        kv_bytes_per_token: {
            let cache = model.new_cache(1, spec.block_size);
            cache.bytes_per_token(cache.dtype())
        },
        cached_parts_ms: Vec::new(),
        prefill_parts_ms: Vec::new(),
        peak_rss_bytes: None,
    };
    use ember_kernels::profile;
    for &c in &spec.contexts {
        let prompts: Vec<Vec<i32>> = (0..batch).map(|row| ids(c, row)).collect();
        let mut cache = model.new_cache(batch, spec.block_size);
        let _ = B::sync(&device);
        profile::set(true);
        let _ = profile::take();
        let start = Instant::now();
        let mut next = greedy(model.forward_cached(input(&prompts), &vec![c; batch], &mut cache));
        let _ = B::sync(&device);
        let secs = start.elapsed().as_secs_f64();
        out.prefill_tokens_per_sec.push((c * batch) as f64 / secs);
        out.prefill_parts_ms.push(PartsMs::split(secs * 1e3, profile::take(), (c * batch) as f64));
        let start = Instant::now();
        for _ in 0..spec.new_tokens {
            let step: Vec<Vec<i32>> = next.iter().map(|&t| vec![t]).collect();
            next = greedy(model.forward_cached(input(&step), &vec![1; batch], &mut cache));
        }
        let _ = B::sync(&device);
        let total = start.elapsed().as_secs_f64() * 1e3;
        profile::set(false);
        let steps = spec.new_tokens.max(1) as f64;
        out.cached_parts_ms.push(PartsMs::split(total, profile::take(), steps));
        let ms = total / steps;
        out.cached_ms_per_token.push(ms);
        out.decode_tokens_per_sec.push(batch as f64 * 1e3 / ms);
        let mut toks = prompts;
        let start = Instant::now();
        for _ in 0..spec.uncached_tokens {
            let next = greedy(model.hidden(input(&toks), 0));
            toks.iter_mut().zip(next).for_each(|(row, t)| row.push(t));
        }
        let _ = B::sync(&device);
        out.uncached_ms_per_token.push(start.elapsed().as_secs_f64() * 1e3 / spec.uncached_tokens.max(1) as f64);
    }
    out.peak_rss_bytes = peak_rss_bytes();
    out
}

fn gib(bytes: Option<u64>) -> String {
    bytes.map_or("n/a".into(), |b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64))
}

impl std::fmt::Display for TrainBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {:.1} ms/step (median of {}, min {:.1}, max {:.1}), {:.0} tokens/s, MFU {:.2}% of {:.3} TFLOP/s ({}), peak memory {}",
            self.device,
            self.precision,
            self.step_ms,
            self.steps,
            self.step_ms_min,
            self.step_ms_max,
            self.tokens_per_sec,
            100.0 * self.mfu,
            self.peak_flops / 1e12,
            self.peak_source,
            gib(self.peak_memory_bytes)
        )
    }
}

impl std::fmt::Display for PeakBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} GEMM peak {:.1} GFLOP/s", self.device, self.dtype, self.peak_flops / 1e9)?;
        for g in &self.gemms {
            write!(f, "\n  {}³: {:.2} ms, {:.1} GFLOP/s", g.n, g.ms, g.flops / 1e9)?;
        }
        if let Some(k) = &self.kernels {
            write!(f, "\n`--precision bf16` on this CPU, each class's products on every kernel:")?;
            for class in ember_kernels::calibrate::Class::ALL {
                write!(f, "\n  {}", crate::calibration::describe(&k.calibration, class))?;
            }
            if let Some(file) = &k.file {
                write!(f, "\n  (kept in {} for runs to read)", file.display())?;
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for LossBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: N {} D {} V {} (tiles {}×{}): plain {:.0} ms, peak {}; chunked {:.0} ms, peak {}; |Δloss| {:.2e}",
            self.device,
            self.tokens,
            self.d_model,
            self.vocab_size,
            self.tile_rows,
            self.tile_vocab,
            self.plain_ms,
            gib(self.plain_peak_bytes),
            self.chunked_ms,
            gib(self.chunked_peak_bytes),
            self.loss_diff
        )
    }
}

impl std::fmt::Display for DecodeBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} decode, batch {}, KV cache {} bytes/token:", self.device, self.batch, self.kv_bytes_per_token)?;
        for i in 0..self.contexts.len() {
            write!(
                f,
                "\n  context {:>5}: cached {:8.2} ms/step ({:.1} tokens/s), uncached {:9.2} ms/step ({:.1}x), prefill {:.0} tokens/s",
                self.contexts[i],
                self.cached_ms_per_token[i],
                self.decode_tokens_per_sec[i],
                self.uncached_ms_per_token[i],
                self.uncached_ms_per_token[i] / self.cached_ms_per_token[i],
                self.prefill_tokens_per_sec[i]
            )?;
            if let (Some(step), Some(prompt)) = (self.cached_parts_ms.get(i), self.prefill_parts_ms.get(i)) {
                write!(f, "\n    a step: {step}\n    a prompt token: {prompt}")?;
            }
        }
        if let Some(b) = self.peak_rss_bytes {
            write!(f, "\n  peak RSS {:.0} MiB", b as f64 / (1u64 << 20) as f64)?;
        }
        Ok(())
    }
}
