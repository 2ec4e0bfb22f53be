//! Mutation fuzzing, on stable Rust, of every parser of outside bytes (issue 39): GGUF files,
//! safetensors folders, checkpoint folders, tokenizer.json, fine-tuning JSONL, chat templates and
//! the server's request bodies. Each parser starts from real files (the fixtures, files ember writes
//! itself here), mutates one of them several times per input (bit flips, bytes overwritten, inserted
//! or deleted, integers such as 0, -1 and `u64::MAX` written over 1/2/4/8 bytes at aligned and
//! unaligned offsets, truncation, chunks duplicated or spliced in from another seed, tokens of the
//! format's own dictionary, numbers replaced) and hands it to the parser and what reads its result,
//! as ember itself would. An error is a fine answer; a panic, an allocation of more than
//! [`HUGE_ALLOC`] bytes, or an input that runs past [`HANG`] is a failure.
//!
//! One `#[test]` per parser runs a bounded number of inputs; `EMBER_FUZZ_ITERS=N` runs N each (the
//! long run: `EMBER_FUZZ_ITERS=200000 cargo test --release --test fuzz -- --nocapture`). Every
//! input is drawn from its own ChaCha seed (the case), printed with a failure and saved under
//! `target/tmp/fuzz/`; `EMBER_FUZZ_CASE=0x…` replays that one case, `EMBER_FUZZ_SEED=N` draws
//! another series.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::DType;
use common::*;
use ember_data::finetune::{ChatTemplate, Message, PackedExamples, Packing};
use ember_data::tokenizer::Tokenizer;
use ember_serve::api::{ChatRequest, CompletionRequest, Generation, Invalid};
use ember_train::checkpoint::Checkpoint;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------------------------------------
// Allocation guard: a mutated length must not make a parser allocate what the file cannot hold.

/// Bytes of one allocation above which an input counts as a failure (the seeds are at most a few
/// hundred KB; nothing they describe needs a quarter of a GiB).
const HUGE_ALLOC: usize = 256 << 20;
/// Bytes of one allocation refused outright (the allocation fails, which aborts the process, after
/// the case has been printed): more than the test machine should be asked for.
const REFUSED_ALLOC: usize = 8 << 30;

thread_local! {
    /// The parser and case this thread runs, while it runs one.
    static CASE: Cell<Option<(&'static str, u64)>> = const { Cell::new(None) };
    /// The largest allocation over `HUGE_ALLOC` the current case asked for.
    static HUGE_SEEN: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, watching the allocations of fuzz cases.
struct Guarded;

impl Guarded {
    /// Whether an allocation of `size` bytes may go ahead (recorded when it is huge).
    fn allow(size: usize) -> bool {
        if size <= HUGE_ALLOC {
            return true;
        }
        let Ok(Some((parser, case))) = CASE.try_with(Cell::get) else { return true };
        let _ = HUGE_SEEN.try_with(|h| h.set(h.get().max(size)));
        if size > REFUSED_ALLOC {
            eprintln!(
                "fuzz {parser}: case {case:#x} asks for {size} bytes: refused; replay with EMBER_FUZZ_CASE={case:#x}"
            );
            return false;
        }
        true
    }
}

// SAFETY: every request is either refused with a null pointer (which `GlobalAlloc` allows) or
// handed to the system allocator unchanged.
unsafe impl GlobalAlloc for Guarded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if Self::allow(layout.size()) {
            // SAFETY: the caller's arguments, passed on unchanged.
            // SAFETY: `ptr` came from the system allocator with `layout`.
            unsafe { System.alloc(layout) }
        } else {
            std::ptr::null_mut()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if Self::allow(layout.size()) {
            // SAFETY: the caller's arguments, passed on unchanged.
            // SAFETY: `ptr` came from the system allocator with `layout`.
            unsafe { System.alloc_zeroed(layout) }
        } else {
            std::ptr::null_mut()
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if Self::allow(new_size) {
            // SAFETY: the caller's arguments, passed on unchanged.
            // SAFETY: `ptr` came from the system allocator with `layout`.
            unsafe { System.realloc(ptr, layout, new_size) }
        } else {
            std::ptr::null_mut()
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from the system allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Guarded = Guarded;

// ---------------------------------------------------------------------------------------------
// Seeds and mutations.

/// One file of a seed: its bytes, how often it is the one mutated, and the leading bytes that hold
/// the structure (a GGUF file's header and tensor infos, a safetensors header), which half the
/// mutations aim at.
struct SeedFile {
    name: String,
    bytes: Vec<u8>,
    weight: u32,
    hot: usize,
}

impl SeedFile {
    fn new(name: &str, bytes: Vec<u8>) -> Self {
        let hot = structure_len(name, &bytes);
        Self { name: name.into(), bytes, weight: 1, hot }
    }

    fn weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }
}

/// A real input: the files of one folder (most parsers read a single file).
struct Seed {
    name: String,
    files: Vec<SeedFile>,
}

impl Seed {
    fn one(name: &str, file: &str, bytes: Vec<u8>) -> Self {
        Self { name: name.into(), files: vec![SeedFile::new(file, bytes)] }
    }

    /// Every file of `dir` (not its subfolders).
    fn folder(name: &str, dir: &Path) -> Self {
        let mut files: Vec<SeedFile> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .map(|p| SeedFile::new(p.file_name().unwrap().to_str().unwrap(), std::fs::read(&p).unwrap()))
            .collect();
        files.sort_by(|a, b| a.name.cmp(&b.name));
        Self { name: name.into(), files }
    }

    /// Makes `name` the file mutated `weight` times as often as the others.
    fn favour(mut self, name: &str, weight: u32) -> Self {
        let f = self.files.iter_mut().find(|f| f.name == name).unwrap_or_else(|| panic!("no {name}"));
        f.weight = weight;
        self
    }
}

/// The bytes before a GGUF file's tensor data, a safetensors file's length and header; the whole
/// of anything else.
fn structure_len(name: &str, bytes: &[u8]) -> usize {
    if bytes.starts_with(b"GGUF") {
        if let Ok(f) = ember_hf::gguf::GgufFile::parse(bytes.to_vec(), Path::new(name)) {
            return f.tensors.iter().map(|t| t.start).min().unwrap_or(bytes.len());
        }
    }
    if name.ends_with(".safetensors") && bytes.len() >= 8 {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        return (8 + n.min(bytes.len() as u64) as usize).min(bytes.len());
    }
    bytes.len()
}

/// Integers that lengths, counts, offsets and types are made of.
const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    3,
    4,
    8,
    0x7f,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    1 << 62,
    i64::MAX as u64,
    u64::MAX,
];

/// The same as decimal text, for the numbers of JSON and TOML files.
const INTERESTING_TEXT: [&str; 16] = [
    "0",
    "-1",
    "1",
    "2",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "99999999999999999999999",
    "1e308",
    "1e999",
    "-0.0",
    "NaN",
];

/// Tokens of JSON, which all the text formats hold some of.
const JSON_DICT: &[&str] = &[
    "{", "}", "[", "]", "\"", ",", ":", "null", "true", "false", "\\u0000", "\\ud800", "\\\"", "[[[[[[[[", "{}", "[]",
    "\"\"",
];

/// A position: in the structure half the time, anywhere otherwise.
fn pos(rng: &mut ChaCha8Rng, len: usize, hot: usize) -> usize {
    if len == 0 {
        return 0;
    }
    let bound = if rng.random_bool(0.5) { hot.clamp(1, len) } else { len };
    rng.random_range(0..bound)
}

/// Applies one random mutation to `b`. `others` are the bytes of other seeds' files, spliced from;
/// `dict` the format's tokens.
fn mutate(rng: &mut ChaCha8Rng, b: &mut Vec<u8>, hot: usize, others: &[&[u8]], dict: &[&str]) {
    let len = b.len();
    match rng.random_range(0..11) {
        // A bit flipped.
        0 if len > 0 => {
            let at = pos(rng, len, hot);
            b[at] ^= 1 << rng.random_range(0..8);
        }
        // A few bytes overwritten with random ones.
        1 if len > 0 => {
            let at = pos(rng, len, hot);
            for x in b.iter_mut().skip(at).take(rng.random_range(1..=4)) {
                *x = rng.random();
            }
        }
        // An interesting integer over 1, 2, 4 or 8 bytes, little- or big-endian, aligned or not.
        2 | 3 if len > 0 => {
            let width = [1usize, 2, 4, 8][rng.random_range(0..4)];
            let mut at = pos(rng, len, hot);
            if rng.random_bool(0.5) {
                at -= at % width;
            }
            let mut v = INTERESTING[rng.random_range(0..INTERESTING.len())];
            if rng.random_bool(0.25) {
                v = v.wrapping_add(rng.random_range(0..3)).wrapping_sub(1);
            }
            let bytes = if rng.random_bool(0.8) { v.to_le_bytes() } else { v.to_be_bytes() };
            let bytes = if rng.random_bool(0.8) { &bytes[..width] } else { &bytes[8 - width..] };
            for (x, y) in b.iter_mut().skip(at).zip(bytes) {
                *x = *y;
            }
        }
        // Truncated.
        4 if len > 0 => b.truncate(pos(rng, len, hot)),
        // Bytes inserted: random, or one byte repeated.
        5 => {
            let at = pos(rng, len + 1, hot + 1);
            let n = rng.random_range(1..=16);
            let run: Vec<u8> =
                if rng.random_bool(0.5) { (0..n).map(|_| rng.random()).collect() } else { vec![rng.random(); n * 8] };
            b.splice(at..at, run);
        }
        // A range deleted.
        6 if len > 0 => {
            let at = pos(rng, len, hot);
            let n = rng.random_range(1..=64).min(len - at);
            b.drain(at..at + n);
        }
        // A chunk duplicated elsewhere.
        7 if len > 0 => {
            let from = pos(rng, len, hot);
            let n = rng.random_range(1..=256).min(len - from);
            let chunk = b[from..from + n].to_vec();
            let at = pos(rng, len + 1, hot + 1);
            b.splice(at..at, chunk);
        }
        // A chunk of another seed's file written over or inserted.
        8 if !others.is_empty() => {
            let other = others[rng.random_range(0..others.len())];
            if other.is_empty() {
                return;
            }
            let from = rng.random_range(0..other.len());
            let n = rng.random_range(1..=512).min(other.len() - from);
            let at = pos(rng, len + 1, hot + 1);
            if rng.random_bool(0.5) {
                b.splice(at..at, other[from..from + n].iter().copied());
            } else {
                let end = (at + n).min(len);
                b.splice(at..end, other[from..from + n].iter().copied());
            }
        }
        // A token of the format inserted or written over.
        9 => {
            let all: Vec<&str> = JSON_DICT.iter().chain(dict).copied().collect();
            let token = all[rng.random_range(0..all.len())].as_bytes();
            let at = pos(rng, len + 1, hot + 1);
            let end = if rng.random_bool(0.5) { at } else { (at + token.len()).min(len) };
            b.splice(at..end, token.iter().copied());
        }
        // A decimal number (the run of digits at or after a position) replaced by an interesting one.
        _ => {
            let at = pos(rng, len + 1, hot + 1);
            let Some(start) = b[at.min(len)..].iter().position(u8::is_ascii_digit).map(|i| i + at) else { return };
            let end = b[start..].iter().position(|c| !c.is_ascii_digit()).map_or(len, |i| i + start);
            let v = INTERESTING_TEXT[rng.random_range(0..INTERESTING_TEXT.len())];
            b.splice(start..end, v.bytes());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The driver.

/// How long one input may take before the run is stopped as hung.
const HANG: Duration = Duration::from_secs(60);
/// An input slower than this is reported.
const SLOW: Duration = Duration::from_secs(1);

/// What a parser and what reads its result made of one input: `Ok` accepted, `Err` refused.
type Verdict = Result<(), String>;

/// A parser's run: counts, and what failed.
#[derive(Default)]
struct Tally {
    tried: usize,
    accepted: usize,
    refused: usize,
    /// Distinct error messages (digits dropped, cut at 80 characters): how many ways the inputs
    /// were told apart.
    kinds: BTreeSet<String>,
    panics: Vec<String>,
    /// Panics caught inside the parser (answered with an error): not failures, but counted.
    caught: usize,
    huge: Vec<String>,
    slow: usize,
    slowest: Duration,
}

/// A case's ChaCha seed: the parser, the series and the input's number, mixed (splitmix64).
fn case_seed(parser: &str, series: u64, i: u64) -> u64 {
    let name = parser.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, c| (h ^ c as u64).wrapping_mul(0x100_0000_01b3));
    let mut z = name ^ series.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn env_u64(key: &str) -> Option<u64> {
    let v = std::env::var(key).ok()?;
    let v = v.trim();
    Some(match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).unwrap_or_else(|_| panic!("{key}={v} is not a number")),
        None => v.parse().unwrap_or_else(|_| panic!("{key}={v} is not a number")),
    })
}

/// The panic hook: quiet (a message kept for the tally) while a fuzz case runs, the default one
/// otherwise.
fn install_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CASE.try_with(Cell::get).ok().flatten().is_some() {
                let _ = LAST_PANIC.try_with(|p| p.set(Some(info.to_string())));
            } else {
                default(info)
            }
        }));
    });
}

thread_local! {
    static LAST_PANIC: Cell<Option<String>> = const { Cell::new(None) };
}

/// Runs `parser` on mutated `seeds`: each input one file of one seed mutated 1 to 8 times, the
/// seed's folder written (under a scratch folder, one per seed) with that file in it, and
/// `run(folder, bytes)` called under `catch_unwind`. Panics if any input panicked,
/// allocated more than [`HUGE_ALLOC`] bytes at once, or the seeds themselves are refused.
fn fuzz(
    parser: &'static str,
    seeds: &[Seed],
    dict: &[&str],
    default_iters: u64,
    run: impl Fn(&Path, &[u8]) -> Verdict,
) {
    install_hook();
    let scratch = Scratch::new();
    let dirs: Vec<PathBuf> = seeds
        .iter()
        .enumerate()
        .map(|(i, seed)| {
            let dir = scratch.path().join(format!("seed{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            for f in &seed.files {
                std::fs::write(dir.join(&f.name), &f.bytes).unwrap();
            }
            dir
        })
        .collect();
    // The seeds themselves must pass: a fuzzer that starts from refused inputs tests only the
    // first check.
    for (seed, dir) in seeds.iter().zip(&dirs) {
        let f = &seed.files[0];
        if let Err(e) = run(dir, &f.bytes) {
            panic!("fuzz {parser}: the seed {} is refused: {e}", seed.name);
        }
    }
    let series = env_u64("EMBER_FUZZ_SEED").unwrap_or(0);
    let cases: Box<dyn Iterator<Item = u64>> = match env_u64("EMBER_FUZZ_CASE") {
        Some(case) => Box::new(std::iter::once(case)),
        None => {
            let n = env_u64("EMBER_FUZZ_ITERS").unwrap_or(default_iters);
            Box::new((0..n).map(move |i| case_seed(parser, series, i)))
        }
    };
    let saved = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
    let started = Instant::now();
    // The watchdog: the start of the input now running (ms since `started`, 0 when none) and its case.
    let (running_since, running_case, done) = (AtomicU64::new(0), AtomicU64::new(0), AtomicBool::new(false));
    let mut tally = Tally::default();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let since = running_since.load(Ordering::Relaxed);
                if since > 0 && started.elapsed().as_millis() as u64 - since > HANG.as_millis() as u64 {
                    let case = running_case.load(Ordering::Relaxed);
                    eprintln!(
                        "fuzz {parser}: case {case:#x} runs past {HANG:?}: hung; replay with EMBER_FUZZ_CASE={case:#x}"
                    );
                    std::process::abort();
                }
            }
        });
        for case in cases {
            let mut rng = ChaCha8Rng::seed_from_u64(case);
            let s = rng.random_range(0..seeds.len());
            let (seed, dir) = (&seeds[s], &dirs[s]);
            let total: u32 = seed.files.iter().map(|f| f.weight).sum();
            let mut pick = rng.random_range(0..total);
            let file = seed
                .files
                .iter()
                .find(|f| {
                    let here = pick < f.weight;
                    pick = pick.saturating_sub(f.weight);
                    here
                })
                .unwrap();
            let others: Vec<&[u8]> = seeds
                .iter()
                .flat_map(|o| &o.files)
                .filter(|o| !std::ptr::eq(*o, file) && o.name.rsplit('.').next() == file.name.rsplit('.').next())
                .map(|o| o.bytes.as_slice())
                .collect();
            let mut bytes = file.bytes.clone();
            let n = 1 + (rng.random::<u32>() | 0x80).trailing_zeros().min(7);
            for _ in 0..n {
                mutate(&mut rng, &mut bytes, file.hot, &others, dict);
            }
            let path = dir.join(&file.name);
            std::fs::write(&path, &bytes).unwrap();

            running_case.store(case, Ordering::Relaxed);
            running_since.store(started.elapsed().as_millis().max(1) as u64, Ordering::Relaxed);
            CASE.with(|c| c.set(Some((parser, case))));
            HUGE_SEEN.with(|h| h.set(0));
            LAST_PANIC.with(|p| p.set(None));
            let t = Instant::now();
            let verdict = catch_unwind(AssertUnwindSafe(|| run(dir, &bytes)));
            let took = t.elapsed();
            CASE.with(|c| c.set(None));
            running_since.store(0, Ordering::Relaxed);
            std::fs::write(&path, &file.bytes).unwrap();

            tally.tried += 1;
            tally.slowest = tally.slowest.max(took);
            if took > SLOW {
                tally.slow += 1;
                eprintln!("fuzz {parser}: case {case:#x} took {took:.1?}");
            }
            let huge = HUGE_SEEN.with(Cell::get);
            let failure = match verdict {
                Ok(Ok(())) => {
                    tally.accepted += 1;
                    None
                }
                Ok(Err(e)) => {
                    tally.refused += 1;
                    let kind: String = e.chars().filter(|c| !c.is_ascii_digit()).take(80).collect();
                    tally.kinds.insert(kind);
                    None
                }
                Err(_) => Some(LAST_PANIC.with(|p| p.take()).unwrap_or_else(|| "a panic".into())),
            };
            // A panic the parser caught itself (and answered with an error).
            if failure.is_none() && LAST_PANIC.with(|p| p.take()).is_some() {
                tally.caught += 1;
            }
            let failure = failure
                .map(|f| ("panic", f))
                .or((huge > 0).then(|| ("huge", format!("{huge} bytes allocated at once"))));
            if let Some((what, message)) = failure {
                std::fs::create_dir_all(&saved).unwrap();
                let input = saved.join(format!("{parser}-{case:016x}-{}", file.name));
                std::fs::write(&input, &bytes).unwrap();
                let line = format!(
                    "case {case:#x} (seed {}, {} mutated, saved as {}): {message}",
                    seed.name,
                    file.name,
                    input.display()
                );
                eprintln!("fuzz {parser}: {what}: {line}");
                if what == "panic" { &mut tally.panics } else { &mut tally.huge }.push(line);
            }
        }
        done.store(true, Ordering::Relaxed);
    });
    println!(
        "fuzz {parser}: {} inputs from {} seeds in {:.1?}: {} accepted, {} refused ({} distinct errors), {} panics \
         ({} caught inside), {} huge allocations, slowest {:.1?} ({} over {SLOW:?})",
        tally.tried,
        seeds.len(),
        started.elapsed(),
        tally.accepted,
        tally.refused,
        tally.kinds.len(),
        tally.panics.len(),
        tally.caught,
        tally.huge.len(),
        tally.slowest,
        tally.slow,
    );
    let failures: Vec<&String> = tally.panics.iter().chain(&tally.huge).collect();
    assert!(
        failures.is_empty(),
        "fuzz {parser}: {} of {} inputs panicked or allocated more than {HUGE_ALLOC} bytes (replay one with \
         EMBER_FUZZ_CASE):\n{}",
        failures.len(),
        tally.tried,
        failures.iter().take(20).map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// The seeds: files of the repository and of ember's own making.

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/hf").join(name)
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The chat template of Qwen3's tokenizer_config.json (the shared assets).
fn qwen3_template() -> String {
    let config: serde_json::Value =
        serde_json::from_slice(&read(&assets().join("tokenizers/qwen3_tokenizer_config.json"))).unwrap();
    config["chat_template"].as_str().unwrap().to_string()
}

/// ChatML, as small as a chat template gets.
const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The chat templates of the repository and the shared assets: ChatML, Qwen3's, Gemma 3's (the
/// one ember gives Gemma 3 GGUF files, and the fixture's).
fn templates() -> Vec<(String, String)> {
    let gemma3: serde_json::Value =
        serde_json::from_slice(&read(&root().join("tests/fixtures/gguf/gemma3.json"))).unwrap();
    vec![
        ("chatml".into(), CHATML.into()),
        ("qwen3".into(), qwen3_template()),
        ("gemma3-gguf".into(), ember_hf::gguf::tokenizer::GEMMA3_CHAT_TEMPLATE.into()),
        ("gemma3-fixture".into(), gemma3["chat_template"].as_str().unwrap().into()),
    ]
}

fn messages() -> Vec<Message> {
    let m = |role: &str, content: &str| Message { role: role.into(), content: content.into() };
    vec![
        m("system", "Be brief."),
        m("user", "What is 2 + 2?"),
        m("assistant", "4, of course: ünïcödé ✓ 🔥"),
        m("user", "<|im_start|>and now?\n"),
    ]
}

/// The fixture tokenizer the text parsers encode with, and the ChatML template.
fn tokenizer_and_template() -> (Tokenizer, ChatTemplate) {
    let tokenizer = Tokenizer::from_file(&fixture("qwen2/tokenizer.json")).unwrap();
    let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).unwrap();
    (tokenizer, template)
}

fn text(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))
}

/// Bounded runs: inputs per parser in the test suite (the whole binary well under a minute on two
/// cores), `EMBER_FUZZ_ITERS` for more.
mod iters {
    pub const GGUF: u64 = 1000;
    pub const SAFETENSORS: u64 = 4000;
    pub const CHECKPOINT: u64 = 3000;
    pub const TOKENIZER: u64 = 2000;
    pub const JSONL: u64 = 5000;
    pub const TEMPLATE: u64 = 5000;
    pub const HTTP: u64 = 5000;
}

// ---------------------------------------------------------------------------------------------
// One test per parser.

/// GGUF files ember exports from the fixtures (f32, f16, bf16, q8_0; byte-level BPE and
/// SentencePiece tokenizers, a chat template), imported as `ember import` does: header, metadata,
/// tensor infos, the model config and tensors, the tokenizer rebuilt from the metadata.
#[test]
fn gguf() {
    use ember_hf::gguf::model::{encode_model, ExportType};
    let device = Default::default();
    let config = serde_json::json!({ "chat_template": qwen3_template(), "eos_token": "<|im_end|>" });
    // Fixtures ember exports (the llama one is not: llama.cpp's `llama` has no Llama 3 RoPE scaling).
    let seeds: Vec<Seed> = [
        ("qwen2", ExportType::F32, Some(&config)),
        ("qwen2", ExportType::Q8_0, None),
        ("gemma3_gguf", ExportType::F16, None),
        ("qwen3", ExportType::Bf16, None),
    ]
    .into_iter()
    .map(|(name, ty, config)| {
        let imported = ember_hf::import::<Flex>(&fixture(name), DType::F32, false, false, &device).unwrap();
        let tokenizer = std::fs::read_to_string(fixture(name).join("tokenizer.json")).unwrap();
        let encoded = encode_model(&imported.model, Some(&imported.hf_config), &tokenizer, config, ty)
            .unwrap_or_else(|e| panic!("{name} {ty:?}: {e}"));
        Seed::one(&format!("{name}-{ty:?}"), "model.gguf", encoded.bytes)
    })
    .collect();
    let dict = [
        "GGUF",
        "general.architecture",
        "general.alignment",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.model",
        "tokenizer.chat_template",
        "qwen2.block_count",
        "llama",
        "gpt2",
        "output.weight",
    ];
    fuzz("gguf", &seeds, &dict, iters::GGUF, |dir, _| {
        let g = ember_hf::gguf::model::import::<Flex>(&dir.join("model.gguf"), DType::F32, &device)
            .map_err(|e| e.to_string())?;
        let tokenizer = Tokenizer::from_json(&g.tokenizer_json).map_err(|e| e.to_string())?;
        tokenizer.encode_prompt("Hello, world! ✓").map_err(|e| e.to_string())?;
        if let Some(t) = g.tokenizer_config.get("chat_template").and_then(|t| t.as_str()) {
            ChatTemplate::new(t.into(), String::new(), String::new()).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
}

/// Hugging Face folders (one file, and four shards with their index): the safetensors headers and
/// the config.json, read into a model as `ember import` does.
#[test]
fn safetensors() {
    let seeds: Vec<Seed> = ["qwen2", "gpt2", "gemma3_text", "llama"]
        .iter()
        .map(|name| {
            let seed = Seed::folder(name, &fixture(name));
            let seed = Seed { files: seed.files.into_iter().filter(|f| f.name != "expected.json").collect(), ..seed };
            // The safetensors files 8 times as often as config.json and the index.
            let files = seed
                .files
                .into_iter()
                .map(|f| if f.name.ends_with(".safetensors") { f.weight(8) } else { f })
                .collect();
            Seed { files, ..seed }
        })
        .collect();
    let dict = ["\"dtype\"", "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "\"F32\"", "\"BF16\"", "\"I64\""];
    let device = Default::default();
    fuzz("safetensors", &seeds, &dict, iters::SAFETENSORS, |dir, _| {
        ember_hf::import::<Flex>(dir, DType::F32, false, false, &device).map(drop).map_err(|e| e.to_string())
    });
}

/// Checkpoint folders: a training run's (model.toml, weights, optimizer moments, state.json,
/// config.toml, a character tokenizer) and an import's (a BPE tokenizer, hf_config.json), opened
/// and their decoder and optimizer state read, as `ember train --resume` and `ember sample` do.
#[test]
fn checkpoint() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write(
        "tiny.toml",
        &tiny_config("")
            .replace("max_steps = 6", "max_steps = 2")
            .replace("checkpoint_interval = 3", "checkpoint_interval = 2"),
    );
    let o = s.ember(&["train", "--config", "tiny.toml", "--run-dir", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["import", fixture("qwen2").to_str().unwrap(), "--out", "imported"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let folder = |run: &str| ember_train::checkpoint::resolve(&s.path().join(run)).unwrap();
    let seeds = [
        Seed::folder("trained", &folder("run")).favour("model.safetensors", 3).favour("optimizer.safetensors", 3),
        Seed::folder("imported", &folder("imported")).favour("model.safetensors", 3),
    ];
    let dict = ["d_model", "vocab_size", "n_layers", "max_seq_len", "step", "format_version", "=", "[model]"];
    let device = Default::default();
    fuzz("checkpoint", &seeds, &dict, iters::CHECKPOINT, |dir, _| {
        let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
        ckpt.decoder::<Flex>(&device).map_err(|e| e.to_string())?;
        if ckpt.state.is_some() {
            ckpt.optimizer_tensors().map_err(|e| e.to_string())?;
        }
        ckpt.hf_config();
        ChatTemplate::from_dir(dir).map_err(|e| e.to_string())?;
        Ok(())
    });
}

/// tokenizer.json files: the fixtures' (byte-level BPE, GPT-2's), a BPE and a character tokenizer
/// ember trains, read and used to encode, decode and stream-decode.
#[test]
fn tokenizer_json() {
    let text = corpus();
    let mut seeds = vec![
        Seed::one("qwen2-fixture", "tokenizer.json", read(&fixture("qwen2/tokenizer.json"))),
        Seed::one("gpt2-fixture", "tokenizer.json", read(&fixture("gpt2/tokenizer.json"))),
        Seed::one("char", "tokenizer.json", Tokenizer::train_char(&text).to_json().unwrap().into_bytes()),
        Seed::one("bpe", "tokenizer.json", Tokenizer::train_bpe(&text, 300).unwrap().to_json().unwrap().into_bytes()),
    ];
    // Its tokenizer_config.json names an end-of-sequence token (read by `with_model_eos`).
    let config = br#"{"eos_token": {"content": "<|im_end|>"}, "bos_token": null}"#.to_vec();
    seeds[0].files.push(SeedFile::new("tokenizer_config.json", config));
    let seeds: Vec<Seed> =
        seeds.into_iter().map(|s| if s.files.len() > 1 { s.favour("tokenizer.json", 4) } else { s }).collect();
    let dict =
        ["\"model\"", "\"vocab\"", "\"merges\"", "\"added_tokens\"", "\"type\"", "\"BPE\"", "\"ByteLevel\"", "\"id\""];
    // Text every seed's vocabulary covers (the character tokenizer's is the corpus's), and text
    // some refuse (their errors are answers too).
    let (known, odd) = ("ROMEO:\nthe night is long, and love doth speak\n\n", "<|im_start|>user\n ünïcödé ✓ 🔥\t\r");
    fuzz("tokenizer.json", &seeds, &dict, iters::TOKENIZER, |dir, _| {
        let t = Tokenizer::from_file(&dir.join("tokenizer.json")).map_err(|e| e.to_string())?.with_model_eos(dir);
        let e = |e: ember_data::DataError| e.to_string();
        let mut ids = t.encode(known).map_err(e)?;
        ids.extend(t.encode_with_special(known).map_err(e)?);
        ids.extend(t.encode_prompt(known).map_err(e)?);
        for odd in [t.encode(odd), t.encode_with_special(odd), t.encode_prompt(odd)] {
            ids.extend(odd.unwrap_or_default());
        }
        ids.extend(0..t.vocab_size().min(512) as u32);
        ids.extend([t.vocab_size() as u32, u32::MAX]);
        let _ = (t.decode(&ids), t.decode_skipping_special(&ids), t.end_ids(), t.eos_id(), t.to_json());
        let mut stream = t.decode_stream(&ids[..3.min(ids.len())]);
        for &id in &ids {
            let _ = stream.step(id);
        }
        let _ = stream.finish();
        for id in [0, 1, u32::MAX] {
            let _ = t.id_to_token(id);
        }
        Ok(())
    });
}

/// Fine-tuning JSONL: chats (the repository's example file), prompt/completion and text rows,
/// read, tokenized through the ChatML template and packed three ways.
#[test]
fn jsonl() {
    let row = |v: serde_json::Value| v.to_string() + "\n";
    let completions: String = (0..20)
        .map(|i| {
            row(serde_json::json!({"prompt": format!("Q{i}: what is {i} + {i}?"), "completion": format!(" {}", 2 * i)}))
        })
        .collect();
    let texts: String = ["ROMEO: the night is long", "JULIET: ünïcödé ✓", "", "NURSE: 🔥\n"]
        .iter()
        .map(|t| row(serde_json::json!({ "text": t })))
        .collect();
    let seeds = [
        Seed::one("gguf_chat", "data.jsonl", read(&root().join("experiments/gguf_chat.jsonl"))),
        Seed::one("completions", "data.jsonl", completions.into_bytes()),
        Seed::one("texts", "data.jsonl", texts.into_bytes()),
    ];
    let dict = [
        "\n",
        "\"messages\"",
        "\"role\"",
        "\"content\"",
        "\"assistant\"",
        "\"tool\"",
        "\"prompt\"",
        "\"completion\"",
        "\"text\"",
    ];
    let (tokenizer, template) = tokenizer_and_template();
    fuzz("jsonl", &seeds, &dict, iters::JSONL, |dir, _| {
        let e = |e: ember_data::DataError| e.to_string();
        let records = ember_data::finetune::read_jsonl(&dir.join("data.jsonl")).map_err(e)?;
        let examples = ember_data::finetune::encode(&records, &tokenizer, Some(&template)).map_err(e)?;
        for packing in [Packing::Documents, Packing::Stream, Packing::None] {
            PackedExamples::new(&examples, 32, 0, packing, true).map_err(e)?;
        }
        Ok(())
    });
}

/// Chat templates (ChatML, Qwen3's, Gemma 3's), compiled and rendered on a chat of four turns,
/// with and without the generation prompt.
#[test]
fn chat_template() {
    let seeds: Vec<Seed> =
        templates().into_iter().map(|(name, t)| Seed::one(&name, "chat_template.jinja", t.into_bytes())).collect();
    let dict = [
        "{%",
        "%}",
        "{{",
        "}}",
        "{#",
        "#}",
        "{%- for m in messages %}",
        "{% endfor %}",
        "{% if ",
        "{% endif %}",
        "{% else %}",
        "messages[-1]",
        "messages[1:]",
        "|length",
        "|tojson",
        "loop.index0",
        "raise_exception('no')",
        "namespace(",
        "range(",
        "recursive",
        " * ",
        "~",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{% set x = ",
    ];
    let messages = messages();
    fuzz("chat template", &seeds, &dict, iters::TEMPLATE, |_, bytes| {
        let t = ChatTemplate::new(text(bytes)?.into(), "<s>".into(), "</s>".into()).map_err(|e| e.to_string())?;
        t.render(&messages, true).map_err(|e| e.to_string())?;
        t.render(&messages[..3], false).map_err(|e| e.to_string())?;
        Ok(())
    });
}

/// The server's request bodies: `/v1/completions` and `/v1/chat/completions` JSON, parsed and
/// checked as the server does (settings, prompt, messages against the template's roles), the
/// prompt rendered and tokenized, the sampler built.
#[test]
fn http_bodies() {
    let bodies = [
        r#"{"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n", "The end"], "seed": -3, "stream": true}"#,
        r#"{"prompt": ["One prompt in a list"], "n": 1, "logprobs": null, "echo": false, "ignore_eos": true, "max_tokens": 4}"#,
        r#"{"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}], "max_completion_tokens": 32, "stream": false}"#,
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "Parts "}, {"type": "text", "text": "joined"}]}, {"role": "assistant", "content": null}, {"role": "user", "content": "ünïcödé ✓ 🔥"}], "temperature": 0, "stop": "STOP", "seed": 9223372036854775807}"#,
    ];
    let seeds: Vec<Seed> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| Seed::one(&format!("body{i}"), "body.json", b.as_bytes().to_vec()))
        .collect();
    let dict = [
        "\"messages\"",
        "\"prompt\"",
        "\"role\"",
        "\"content\"",
        "\"type\"",
        "\"user\"",
        "\"max_tokens\"",
        "\"temperature\"",
        "\"top_p\"",
        "\"stop\"",
        "\"seed\"",
    ];
    let (tokenizer, template) = tokenizer_and_template();
    let sample = |g: Generation| {
        ember_generate::sample::Sampler::new(g.sampling, g.seed.unwrap_or(0)).map(drop).map_err(|e| e.to_string())
    };
    let invalid = |e: Invalid| format!("{}: {}", e.param, e.message);
    let defaults = ember_serve::sampling::ChatDefaults::built_in().sampling;
    fuzz("http bodies", &seeds, &dict, iters::HTTP, |_, bytes| {
        let completion = serde_json::from_slice::<CompletionRequest>(bytes).map_err(|e| e.to_string()).and_then(|r| {
            let prompt = r.prompt().map_err(invalid)?;
            let g = r.settings.generation("m", &defaults).map_err(invalid)?;
            tokenizer.encode_prompt(prompt).map_err(|e| e.to_string())?;
            sample(g)
        });
        let chat = serde_json::from_slice::<ChatRequest>(bytes).map_err(|e| e.to_string()).and_then(|r| {
            let g = r.settings.generation("m", &defaults).map_err(invalid)?;
            let messages = r.messages(template.roles()).map_err(invalid)?;
            let prompt = template.render(&messages, true).map_err(|e| e.to_string())?;
            tokenizer.encode_prompt(&prompt).map_err(|e| e.to_string())?;
            sample(g)
        });
        completion.or(chat)
    });
}

/// What the fuzzing found in `Tokenizer::from_json` (crates/data/src/tokenizer.rs), kept: a JSON
/// error inside `decoder` made `tokenizers` 0.22 panic ("Helper"); an id of 10^8 in a vocabulary of
/// a few hundred made saving the tokenizer name every hole (it ran past the one-minute guard).
#[test]
fn tokenizer_json_regressions() {
    let good = String::from_utf8(read(&fixture("qwen2/tokenizer.json"))).unwrap();
    let at = good.find("\"decoder\"").expect("a decoder");
    for tail in ["\"decoder\": {\"type\": \"ByteLevel\", \"x\": \"\\ud800\\", "\"decoder\": {\"type\": "] {
        let bad = format!("{}{tail}", &good[..at]);
        let e = catch_unwind(|| Tokenizer::from_json(&bad)).expect("no panic").expect_err("a damaged decoder");
        eprintln!("{e}");
    }
    let mut sparse: serde_json::Value = serde_json::from_str(&good).unwrap();
    sparse["model"]["vocab"]["<|far|>"] = 100_000_000.into();
    let e = Tokenizer::from_json(&sparse.to_string()).expect_err("ids that sparse");
    assert!(e.to_string().contains("\"<|far|>\" has id 100000000"), "{e}");
}
