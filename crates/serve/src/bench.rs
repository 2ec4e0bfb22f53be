//! `ember bench serve`: N concurrent streaming clients against a server, as a chat front end
//! would load it. Each client sends its requests one after the other; every request streams
//! `max_tokens` tokens (`ignore_eos`), so that all runs do the same work.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

/// What N clients measured.
#[derive(Debug, Clone, Serialize)]
pub struct Load {
    pub clients: usize,
    pub requests: usize,
    pub tokens: usize,
    pub wall_s: f64,
    /// Completion tokens of all clients per second of wall time.
    pub tokens_per_s: f64,
    /// Time to first token, from sending the request.
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Time between streamed pieces of one answer.
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// The server's KV cache over the run (from `/health`), when it reports one.
    pub cache: Option<CacheDuring>,
}

/// What the server's KV cache did over a load run.
#[derive(Debug, Clone, Serialize)]
pub struct CacheDuring {
    pub block_size: u64,
    /// The most blocks held at once since the server started.
    pub peak_blocks: u64,
    /// Prompt tokens of the run's requests, and of those the ones that started from a shared prefix.
    pub prompt_tokens: u64,
    pub reused_prompt_tokens: u64,
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:>3} clients: {:>7.1} tok/s aggregate ({} tokens in {:.1} s); first token p50 {:.0} ms, p99 {:.0} ms; between tokens p50 {:.1} ms, p99 {:.1} ms",
            self.clients, self.tokens_per_s, self.tokens, self.wall_s, self.ttft_p50_ms, self.ttft_p99_ms, self.itl_p50_ms, self.itl_p99_ms
        )?;
        if let Some(c) = &self.cache {
            write!(
                f,
                "; KV cache: at most {} blocks of {} held, {} of {} prompt tokens from a shared prefix",
                c.peak_blocks, c.block_size, c.reused_prompt_tokens, c.prompt_tokens
            )?;
        }
        Ok(())
    }
}

/// One streamed request's timings.
struct Timed {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

/// A load run that could not finish: which request failed, and how.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("request to {url}: {message}")]
    Request { url: String, message: String },
    #[error("request to {url}: the stream ended before any token")]
    NoToken { url: String },
    #[error("a client thread panicked")]
    Panicked,
}

fn stream_once(url: &str, prompt: &str, max_tokens: usize, seed: u64) -> Result<Timed, LoadError> {
    let failed = |message: String| LoadError::Request { url: url.to_string(), message };
    let body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    let start = Instant::now();
    let resp = ureq::post(url)
        .timeout(Duration::from_secs(600))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map_err(|e| match e {
            // The server's own words: the error body names the problem.
            ureq::Error::Status(code, r) => failed(format!("{code}: {}", r.into_string().unwrap_or_default())),
            other => failed(other.to_string()),
        })?;
    let (mut first, mut last, mut gaps, mut tokens) = (None, None, Vec::new(), 0);
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line.map_err(|e| failed(e.to_string()))?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let now = Instant::now();
        let chunk: Value = serde_json::from_str(data).map_err(|e| failed(format!("a chunk that is not JSON: {e}")))?;
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
            continue;
        }
        // The finish chunk (an empty text with the reason) carries no token.
        if chunk["choices"][0]["text"].as_str().is_none_or(str::is_empty) {
            continue;
        }
        match last {
            None => first = Some(now - start),
            Some(prev) => gaps.push(now - prev),
        }
        last = Some(now);
    }
    let ttft = first.ok_or_else(|| LoadError::NoToken { url: url.to_string() })?;
    Ok(Timed { ttft, gaps, tokens })
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The server's `/health` KV-cache counters, if it reports them.
fn cache_counters(base: &str) -> Option<Value> {
    let health: Value =
        serde_json::from_str(&ureq::get(&format!("{base}/health")).call().ok()?.into_string().ok()?).ok()?;
    Some(health.get("kv_cache")?.clone())
}

/// `clients` threads, each streaming `requests` answers of `max_tokens` from `base` (http://host:port),
/// request `r` of client `c` with the prompt `prompt(c, r)`.
pub fn load(
    base: &str,
    clients: usize,
    requests: usize,
    prompt: &(dyn Fn(usize, usize) -> String + Sync),
    max_tokens: usize,
) -> Result<Load, LoadError> {
    let url = format!("{base}/v1/completions");
    let before = cache_counters(base);
    let start = Instant::now();
    let results: Vec<Result<Vec<Timed>, LoadError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let url = url.as_str();
                scope.spawn(move || {
                    (0..requests).map(|r| stream_once(url, &prompt(c, r), max_tokens, (c * 1000 + r) as u64)).collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(Err(LoadError::Panicked))).collect()
    });
    let wall_s = start.elapsed().as_secs_f64();
    let after = cache_counters(base);
    let cache = before.zip(after).map(|(b, a)| {
        let n = |v: &Value, key: &str| v[key].as_u64().unwrap_or(0);
        CacheDuring {
            block_size: n(&a, "block_size"),
            peak_blocks: n(&a, "peak_blocks"),
            prompt_tokens: n(&a, "prompt_tokens").saturating_sub(n(&b, "prompt_tokens")),
            reused_prompt_tokens: n(&a, "reused_prompt_tokens").saturating_sub(n(&b, "reused_prompt_tokens")),
        }
    });
    let timed: Vec<Timed> = results.into_iter().collect::<Result<Vec<_>, _>>()?.into_iter().flatten().collect();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let ttft: Vec<f64> = timed.iter().map(|t| ms(&t.ttft)).collect();
    let gaps: Vec<f64> = timed.iter().flat_map(|t| t.gaps.iter().map(ms)).collect();
    let tokens: usize = timed.iter().map(|t| t.tokens).sum();
    Ok(Load {
        clients,
        requests: timed.len(),
        tokens,
        wall_s,
        tokens_per_s: tokens as f64 / wall_s,
        ttft_p50_ms: percentile(ttft.clone(), 0.5),
        ttft_p99_ms: percentile(ttft, 0.99),
        itl_p50_ms: percentile(gaps.clone(), 0.5),
        itl_p99_ms: percentile(gaps, 0.99),
        cache,
    })
}
