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
//! Beside the mutations, structure-aware generators (issue 57) build inputs from the format's own
//! names and shapes: config files from the section structs' keys and the shipped configs, with
//! values of every type and edge; preference and chat JSONL rows with roles, contents and types at
//! random. Those check what an answer says too: a config error names a line, a section or a key,
//! an accepted config writes back to TOML that reads the same; a JSONL error names the file and a
//! line of it that holds a row.
//!
//! One `#[test]` per parser runs a bounded number of inputs; `EMBER_FUZZ_ITERS=N` runs N each (the
//! long run: `EMBER_FUZZ_ITERS=200000 cargo test --release --test fuzz -- --nocapture`). Every
//! input is drawn from its own ChaCha seed (the case), printed with a failure and saved under
//! `target/tmp/fuzz/`; `EMBER_FUZZ_CASE=0x…` replays that one case, `EMBER_FUZZ_SEED=N` draws
//! another series, `EMBER_FUZZ_ERRORS=1` prints one message of each kind of error.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::DType;
use common::*;
use ember_data::finetune::{ChatTemplate, Message, PackedExamples, Packing};
use ember_data::tokenizer::Tokenizer;
use ember_serve::api::{ChatRequest, CompletionRequest, Generation, Invalid, Kind, Prompts, Served};
use ember_train::checkpoint::Checkpoint;
use ember_train::config::Purpose;
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
    /// were told apart; each with the first message of its kind (`EMBER_FUZZ_ERRORS=1` prints them).
    kinds: BTreeMap<String, String>,
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
    let from = format!("{} seeds", seeds.len());
    let make = |rng: &mut ChaCha8Rng| {
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
            mutate(rng, &mut bytes, file.hot, &others, dict);
        }
        let origin = format!("seed {}, {} mutated", seed.name, file.name);
        Input { dir: dir.as_path(), name: &file.name, bytes, origin, restore: Some(&file.bytes) }
    };
    drive(parser, &from, default_iters, make, run);
}

/// One input drawn from a case: the file `name` in `dir` holds `bytes` while the parser runs, and
/// `restore` (where given) after; `origin` says what it was made from.
struct Input<'a> {
    dir: &'a Path,
    name: &'a str,
    bytes: Vec<u8>,
    origin: String,
    restore: Option<&'a [u8]>,
}

/// Runs `parser` on the inputs `make` draws from the cases (`from` says from what): each written,
/// and `run(dir, bytes)` called under `catch_unwind`. Panics if any input panicked or allocated
/// more than [`HUGE_ALLOC`] bytes at once; aborts on one that runs past [`HANG`].
fn drive<'a>(
    parser: &'static str,
    from: &str,
    default_iters: u64,
    make: impl Fn(&mut ChaCha8Rng) -> Input<'a>,
    run: impl Fn(&Path, &[u8]) -> Verdict,
) {
    install_hook();
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
            let Input { dir, name, bytes, origin, restore } = make(&mut rng);
            let path = dir.join(name);
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
            if let Some(restore) = restore {
                std::fs::write(&path, restore).unwrap();
            }

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
                    tally.kinds.entry(kind).or_insert(e);
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
                let input = saved.join(format!("{parser}-{case:016x}-{name}"));
                std::fs::write(&input, &bytes).unwrap();
                let line = format!("case {case:#x} ({origin}, saved as {}): {message}", input.display());
                eprintln!("fuzz {parser}: {what}: {line}");
                if what == "panic" { &mut tally.panics } else { &mut tally.huge }.push(line);
            }
        }
        done.store(true, Ordering::Relaxed);
    });
    println!(
        "fuzz {parser}: {} inputs from {from} in {:.1?}: {} accepted, {} refused ({} distinct errors), {} panics \
         ({} caught inside), {} huge allocations, slowest {:.1?} ({} over {SLOW:?})",
        tally.tried,
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
    if std::env::var_os("EMBER_FUZZ_ERRORS").is_some() {
        for message in tally.kinds.values() {
            println!("fuzz {parser}: refused: {message}");
        }
    }
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
        ("gemma3-gguf".into(), ember_hf::families::gemma3::GEMMA3_CHAT_TEMPLATE.into()),
        ("gemma3-fixture".into(), gemma3["chat_template"].as_str().unwrap().into()),
    ]
}

fn messages() -> Vec<Message> {
    let m = |role: &str, content: &str| Message::new(role, content);
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
    pub const CONFIG: u64 = 2000;
    pub const PREFERENCE: u64 = 2000;
    pub const CHAT: u64 = 2000;
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
        "\"n\"",
        "\"logprobs\"",
        "\"top_logprobs\"",
        "\"logit_bias\"",
        "\"response_format\"",
        "\"json_schema\"",
        "\"tools\"",
        "\"tool_choice\"",
        "\"stream_options\"",
    ];
    let (tokenizer, template) = tokenizer_and_template();
    let sample = |g: Generation| {
        ember_generate::sample::Sampler::new(g.sampling, g.seed.unwrap_or(0))
            .and_then(|s| s.adjusted(g.adjustments))
            .map(drop)
            .map_err(|e| e.to_string())
    };
    let invalid = |e: Invalid| format!("{}: {}", e.param, e.message);
    let served = Served {
        model: "m".into(),
        vocab_size: tokenizer.vocab_size(),
        defaults: ember_serve::sampling::ChatDefaults::built_in().sampling,
    };
    fuzz("http bodies", &seeds, &dict, iters::HTTP, |_, bytes| {
        let completion = serde_json::from_slice::<CompletionRequest>(bytes).map_err(|e| e.to_string()).and_then(|r| {
            let g = r.settings.generation(Kind::Completion, &served).map_err(invalid)?;
            if let Prompts::Texts(texts) = &r.prompt {
                for prompt in texts {
                    tokenizer.encode_prompt(prompt).map_err(|e| e.to_string())?;
                }
            }
            sample(g)
        });
        let chat = serde_json::from_slice::<ChatRequest>(bytes).map_err(|e| e.to_string()).and_then(|r| {
            let g = r.settings.generation(Kind::Chat, &served).map_err(invalid)?;
            let messages = r.messages(template.roles()).map_err(invalid)?;
            let prompt = template.render(&messages, true).map_err(|e| e.to_string())?;
            tokenizer.encode_prompt(&prompt).map_err(|e| e.to_string())?;
            sample(g)
        });
        completion.or(chat)
    });
}

// ---------------------------------------------------------------------------------------------
// Structure-aware generators (issue 57): inputs built from the format's own names, shapes and edge
// values, which get past the syntax that most byte mutations break, down to the rules behind it.

/// Runs `parser` on what `generate` makes of each case's ChaCha stream (what it was made from, and
/// the bytes), written as `name` in a scratch folder; `run` as in [`fuzz`]. A property `run` finds
/// broken is a panic, reported with the case like any other.
fn generated(
    parser: &'static str,
    name: &str,
    default_iters: u64,
    generate: impl Fn(&mut ChaCha8Rng) -> (String, Vec<u8>),
    run: impl Fn(&Path, &[u8]) -> Verdict,
) {
    let scratch = Scratch::new();
    let make = |rng: &mut ChaCha8Rng| {
        let (origin, bytes) = generate(rng);
        Input { dir: scratch.path(), name, bytes, origin, restore: None }
    };
    drive(parser, "a generator", default_iters, make, run);
}

/// One of `items`.
fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> &'a T {
    &items[rng.random_range(0..items.len())]
}

/// What config files are made of: the sections and their keys (from the section structs, as the
/// validator reads them), the shipped configs (configs/*.toml, `ember init`'s templates among
/// them), the values those give each key, and the words string keys take.
struct ConfigSchema {
    /// `section` (nested ones dotted: `model.moe`, `rl.rewards`) and its keys.
    sections: Vec<(String, Vec<String>)>,
    /// Every section and key name: an error names one of them (or a line).
    names: BTreeSet<String>,
    /// The shipped configs, parsed: name and table.
    shipped: Vec<(String, toml::Table)>,
    /// Values the shipped configs give, by key (in any section).
    examples: BTreeMap<String, Vec<toml::Value>>,
    /// The variants of the config's enums and the shipped configs' strings.
    words: Vec<String>,
}

impl ConfigSchema {
    fn new() -> Self {
        use ember_model::{LoraConfig, MlaConfig, MlpKind, ModelConfig, MoeConfig, NormKind, Positions, RopeLayout};
        use ember_train::config::*;
        let fields = |f: &'static [&'static str]| f.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        let mut sections: Vec<(String, Vec<String>)> = [
            ("model", serde_names::<ModelConfig>().0),
            ("model.moe", serde_names::<MoeConfig>().0),
            ("model.mla", serde_names::<MlaConfig>().0),
            ("data", serde_names::<DataConfig>().0),
            ("train", serde_names::<LoopConfig>().0),
            ("optim", serde_names::<OptimConfig>().0),
            ("schedule", serde_names::<ScheduleConfig>().0),
            ("lora", serde_names::<LoraConfig>().0),
            ("muon", serde_names::<MuonConfig>().0),
            ("preference", serde_names::<PreferenceConfig>().0),
            ("rl", serde_names::<RlConfig>().0),
            ("rl.rewards", serde_names::<RewardConfig>().0),
            ("eval", serde_names::<EvalTasksConfig>().0),
            ("metrics", serde_names::<MetricsConfig>().0),
            ("distributed", serde_names::<DistributedConfig>().0),
        ]
        .into_iter()
        .map(|(s, f)| (s.to_string(), fields(f)))
        .collect();
        // `rope_scaling` is an enum tagged by `type` (ember_kernels::rope::RopeScaling), whose
        // derive names no fields: its keys as written there.
        let rope = "type factor low_freq_factor high_freq_factor original_max_position_embeddings beta_fast \
                    beta_slow mscale mscale_all_dim attention_factor truncate";
        sections.push(("model.rope_scaling".into(), rope.split(' ').map(String::from).collect()));
        for (section, keys) in &sections {
            assert!(!keys.is_empty(), "no keys read for [{section}]");
        }
        // Every section of the file is here: a new one is fuzzed once it is listed above.
        let top = serde_names::<TrainConfig<Option<ModelConfig>>>().0;
        for name in top.iter().filter(|n| **n != "init_from") {
            assert!(sections.iter().any(|(s, _)| s == name), "[{name}] is not in the fuzzer's list of sections");
        }
        let mut words: Vec<String> = [
            serde_names::<DataFormat>().1,
            serde_names::<SinkKind>().1,
            serde_names::<EvalStrategy>().1,
            serde_names::<Precision>().1,
            serde_names::<AdjustLr>().1,
            serde_names::<NsDtype>().1,
            serde_names::<RlMethod>().1,
            serde_names::<RlLoss>().1,
            serde_names::<Importance>().1,
            serde_names::<ScaleRewards>().1,
            serde_names::<RewardKind>().1,
            serde_names::<PreferenceMethod>().1,
            serde_names::<ScheduleShape>().1,
            serde_names::<NormKind>().1,
            serde_names::<MlpKind>().1,
            serde_names::<Positions>().1,
            serde_names::<RopeLayout>().1,
            serde_names::<Packing>().1,
            &["linear", "llama3", "yarn"],
        ]
        .concat()
        .into_iter()
        .map(String::from)
        .collect();
        let mut shipped = Vec::new();
        let mut examples: BTreeMap<String, Vec<toml::Value>> = BTreeMap::new();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(root().join("configs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        paths.sort();
        for path in paths {
            let text = String::from_utf8(read(&path)).unwrap();
            let table: toml::Table = text.parse().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            collect_examples(&table, "", &mut sections, &mut examples, &mut words);
            shipped.push((path.file_name().unwrap().to_string_lossy().into_owned(), table));
        }
        assert!(shipped.len() >= 5, "the shipped configs are missing");
        words.sort();
        words.dedup();
        let mut names: BTreeSet<String> = BTreeSet::from(["init_from".to_string()]);
        for (section, keys) in &sections {
            names.extend(section.split('.').map(String::from));
            names.extend(keys.iter().cloned());
        }
        Self { sections, names, shipped, examples, words }
    }
}

/// Records the keys and values of `table` (at `prefix`) as examples, and any nested table the
/// schema lacks as a section.
fn collect_examples(
    table: &toml::Table,
    prefix: &str,
    sections: &mut Vec<(String, Vec<String>)>,
    examples: &mut BTreeMap<String, Vec<toml::Value>>,
    words: &mut Vec<String>,
) {
    for (key, value) in table {
        let dotted = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        let tables: Vec<&toml::Table> = match value {
            toml::Value::Table(t) => vec![t],
            toml::Value::Array(a) if !a.is_empty() && a.iter().all(toml::Value::is_table) => {
                a.iter().filter_map(toml::Value::as_table).collect()
            }
            _ => vec![],
        };
        if tables.is_empty() {
            if let toml::Value::String(s) = value {
                words.push(s.clone());
            }
            examples.entry(key.clone()).or_default().push(value.clone());
            continue;
        }
        for t in tables {
            match sections.iter_mut().find(|(s, _)| *s == dotted) {
                Some((_, keys)) => {
                    keys.extend(t.keys().filter(|k| !t[*k].is_table()).cloned());
                    keys.sort();
                    keys.dedup();
                }
                None => sections.push((dotted.clone(), t.keys().cloned().collect())),
            }
            collect_examples(t, &dotted, sections, examples, words);
        }
    }
}

/// Integers lengths, counts, rates and seeds are made of (TOML integers are i64: 2^63 and above
/// are written as text, by [`mutate_config_text`]).
const EDGE_INTS: [i64; 17] = [
    0,
    1,
    -1,
    2,
    3,
    7,
    64,
    1000,
    65_536,
    i32::MAX as i64,
    1 << 31,
    1 << 32,
    (1 << 53) + 1,
    1 << 62,
    i64::MAX,
    i64::MIN,
    -(1 << 40),
];

const EDGE_FLOATS: [f64; 17] = [
    0.0,
    -0.0,
    -1.0,
    0.5,
    1.0,
    2.0,
    1e-12,
    1e-300,
    5e-324,
    1e300,
    f64::MAX,
    f64::NAN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    0.999_999_9,
    1.000_000_1,
    65_536.5,
];

const EDGE_STRINGS: [&str; 16] = [
    "",
    " ",
    "x",
    "ünïcödé ✓ 🔥",
    "\u{0}",
    "a\nb",
    "hf:",
    "run:",
    "gguf:",
    "hf:/nonexistent",
    "gguf:/dev/null",
    "run:runs/x",
    "/dev/zero",
    "tokenizer.json",
    "bpe:256",
    "~/x",
];

/// A value for `key`: one the shipped configs give it or a neighbour of one, or any TOML value,
/// most of them at an edge.
fn config_value(rng: &mut ChaCha8Rng, schema: &ConfigSchema, key: &str, depth: usize) -> toml::Value {
    use toml::Value as V;
    let example = schema.examples.get(key).map(|e| pick(rng, e).clone());
    if let Some(example) = &example {
        if rng.random_bool(0.3) {
            return example.clone();
        }
    }
    match rng.random_range(0..14) {
        0..=3 if example.is_some() => example.unwrap(),
        // A neighbour of the example: off by one, scaled, negated.
        4 if example.is_some() => match example.unwrap() {
            V::Integer(n) => V::Integer(match rng.random_range(0..4) {
                0 => n.wrapping_add(1),
                1 => n.wrapping_sub(1),
                2 => n.wrapping_neg(),
                _ => n.wrapping_mul(1 << rng.random_range(1..40)),
            }),
            V::Float(x) => V::Float(*pick(rng, &[-x, x * 1e10, x / 1e10, x + 1.0, (x * 1e6).round()])),
            V::String(_) => V::String(pick(rng, &schema.words).clone()),
            other => other,
        },
        0..=5 => V::Integer(match rng.random_bool(0.8) {
            true => *pick(rng, &EDGE_INTS),
            false => rng.random_range(-100..100_000),
        }),
        6 | 7 => V::Float(*pick(rng, &EDGE_FLOATS)),
        8 => V::String(match rng.random_range(0..40) {
            0 => "ab".repeat(50_000),
            1..=20 => pick(rng, &schema.words).clone(),
            _ => pick(rng, &EDGE_STRINGS).to_string(),
        }),
        9 => V::Boolean(rng.random()),
        // An array where a scalar goes (or where a list goes, one of anything).
        10 | 11 if depth < 3 => {
            let n = rng.random_range(0..4);
            V::Array((0..n).map(|_| config_value(rng, schema, key, depth + 1)).collect())
        }
        12 if depth < 3 => {
            let mut t = toml::Table::new();
            if rng.random_bool(0.5) {
                t.insert(key.into(), config_value(rng, schema, key, depth + 1));
            }
            V::Table(t)
        }
        _ => V::Datetime("1979-05-27T07:32:00Z".parse().unwrap()),
    }
}

/// The table at the dotted `path` of `t`, made where missing (`rewards`: an element of the array
/// of tables); `None` where something else stands in its place.
fn table_at<'t>(rng: &mut ChaCha8Rng, mut t: &'t mut toml::Table, path: &str) -> Option<&'t mut toml::Table> {
    for part in path.split('.') {
        let empty = toml::Value::Table(toml::Table::new());
        let fresh = if part == "rewards" { toml::Value::Array(vec![empty]) } else { empty };
        t = match t.entry(part).or_insert(fresh) {
            toml::Value::Table(inner) => inner,
            toml::Value::Array(items) => {
                if items.is_empty() {
                    items.push(toml::Value::Table(toml::Table::new()));
                }
                let i = rng.random_range(0..items.len());
                items[i].as_table_mut()?
            }
            _ => return None,
        };
    }
    Some(t)
}

/// A key someone might write for `key`: a letter dropped, doubled or swapped, or its case changed.
fn typo(rng: &mut ChaCha8Rng, key: &str) -> String {
    let mut c: Vec<char> = key.chars().collect();
    if c.len() < 2 {
        return format!("{key}{key}");
    }
    let i = rng.random_range(0..c.len() - 1);
    match rng.random_range(0..4) {
        0 => drop(c.remove(i)),
        1 => c.insert(i, c[i]),
        2 => c.swap(i, i + 1),
        _ => return key.to_uppercase(),
    }
    c.into_iter().collect()
}

/// One change to a config's table: a known key set, a key or section taken out, an unknown or
/// misplaced key or section added, a section replaced by a value, `init_from` changed.
fn edit_config(rng: &mut ChaCha8Rng, schema: &ConfigSchema, t: &mut toml::Table) {
    let (section, keys) = pick(rng, &schema.sections).clone();
    match rng.random_range(0..12) {
        0..=4 => {
            let key = pick(rng, &keys).clone();
            let value = config_value(rng, schema, &key, 0);
            if let Some(s) = table_at(rng, t, &section) {
                s.insert(key, value);
            }
        }
        5 => {
            if let Some(s) = table_at(rng, t, &section) {
                let present: Vec<String> = s.keys().cloned().collect();
                if !present.is_empty() {
                    s.remove(pick(rng, &present));
                }
            }
        }
        6 => {
            let present: Vec<String> = t.keys().cloned().collect();
            if !present.is_empty() {
                t.remove(pick(rng, &present));
            }
        }
        // An unknown key: a typo of one of the section's, another section's, or none at all.
        7 | 8 => {
            let key = match rng.random_range(0..3) {
                0 => {
                    let key = pick(rng, &keys).clone();
                    typo(rng, &key)
                }
                1 => {
                    let other = &pick(rng, &schema.sections).1;
                    pick(rng, other).clone()
                }
                _ => pick(rng, &["zz", "", " ", "model", "init_from", "a.b", "ünï"]).to_string(),
            };
            let value = config_value(rng, schema, &key, 0);
            if let Some(s) = table_at(rng, t, &section) {
                s.insert(key, value);
            }
        }
        // An unknown or misplaced section.
        9 => {
            let name = match rng.random_range(0..3) {
                0 => typo(rng, section.split('.').next().unwrap()),
                1 => format!("{}.{}", pick(rng, &schema.sections).0, pick(rng, &schema.sections).0),
                _ => pick(rng, &keys).clone(),
            };
            let key = pick(rng, &keys).clone();
            let value = config_value(rng, schema, &key, 0);
            if let Some(s) = table_at(rng, t, &name) {
                s.insert(key, value);
            }
        }
        // A section (or `init_from`) as a value: `train = 3`, `[model] moe = [1]`.
        10 => {
            let value = config_value(rng, schema, &section, 0);
            match section.split_once('.') {
                Some((outer, inner)) => {
                    if let Some(s) = table_at(rng, t, outer) {
                        s.insert(inner.into(), value);
                    }
                }
                None => drop(t.insert(section.clone(), value)),
            }
        }
        _ => {
            let value = config_value(rng, schema, "init_from", 0);
            t.insert("init_from".into(), value);
        }
    }
}

/// Text-level changes TOML tables cannot hold: a section or key given twice, integers of 2^63
/// and above, special floats written as words, a line cut short, bytes mutated.
fn mutate_config_text(rng: &mut ChaCha8Rng, text: &mut String, schema: &ConfigSchema) {
    let lines: Vec<&str> = text.lines().collect();
    let line = if lines.is_empty() { "" } else { *pick(rng, &lines) };
    match rng.random_range(0..6) {
        // A section twice.
        0 => {
            let header = lines.iter().find(|l| l.starts_with('[')).copied().unwrap_or("[train]");
            text.push_str(&format!("\n{header}\nmax_steps = 3\n"));
        }
        // A key twice.
        1 if line.contains(" = ") => {
            let at = text.find(line).unwrap() + line.len();
            text.insert_str(at, &format!("\n{line}"));
        }
        // A number replaced by one of these.
        2 | 3 => {
            let digit = |c: char| c.is_ascii_digit();
            let skip = rng.random_range(0..=text.len());
            let skip = (0..=skip).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
            let Some(start) = text[skip..].find(digit).map(|j| j + skip).or_else(|| text.find(digit)) else {
                return;
            };
            let end = text[start..].find(|c: char| !c.is_ascii_digit()).map_or(text.len(), |j| j + start);
            let huge = [
                "9223372036854775808",
                "18446744073709551615",
                "-9223372036854775809",
                "99999999999999999999999",
                "1e999",
                "nan",
                "-inf",
                "0x7fffffffffffffff",
                "0b1",
                "1_000",
                "1__0",
            ];
            let choice: &&str = pick(rng, &huge);
            text.replace_range(start..end, choice);
        }
        // A line cut short.
        4 if !line.is_empty() => {
            let at = text.find(line).unwrap();
            let cut = line.char_indices().map(|(i, _)| i).nth(rng.random_range(0..line.chars().count())).unwrap();
            text.replace_range(at + cut..at + line.len(), "");
        }
        // Bytes mutated, with the names of the format as its dictionary.
        _ => {
            let names: Vec<&str> = schema.names.iter().map(String::as_str).collect();
            let dict: Vec<&str> = ["=", "[", "]", "[[", "]]", "\"", "'''", "#", "\n", ".", "{", "}", "inf", "nan"]
                .into_iter()
                .chain(names)
                .collect();
            let mut bytes = std::mem::take(text).into_bytes();
            let hot = bytes.len();
            mutate(rng, &mut bytes, hot, &[], &dict);
            *text = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
}

/// A config file: a shipped one changed a few times (written back as TOML), made up from the
/// schema, or either of them changed as text.
fn config_file(rng: &mut ChaCha8Rng, schema: &ConfigSchema) -> (String, Vec<u8>) {
    let (origin, mut table) = if rng.random_bool(0.85) {
        let (name, table) = pick(rng, &schema.shipped);
        (name.clone(), table.clone())
    } else {
        // Sections of keys drawn at random: most of them refused for a key left out or mistyped.
        let mut t = toml::Table::new();
        for (section, keys) in &schema.sections {
            if rng.random_bool(0.4) {
                for key in keys {
                    if !rng.random_bool(0.4) {
                        continue;
                    }
                    let value = config_value(rng, schema, key, 0);
                    if let Some(s) = table_at(rng, &mut t, section) {
                        s.insert(key.clone(), value);
                    }
                }
            }
        }
        ("made up".to_string(), t)
    };
    let edits = 1 + (rng.random::<u32>() | 0x10).trailing_zeros();
    for _ in 0..edits {
        edit_config(rng, schema, &mut table);
    }
    let mut text = toml::to_string(&table).unwrap_or_else(|e| format!("# {e}\n"));
    let as_text = if rng.random_bool(0.25) { rng.random_range(1..=3) } else { 0 };
    for _ in 0..as_text {
        mutate_config_text(rng, &mut text, schema);
    }
    (format!("{origin}, {edits} edits, {as_text} as text"), text.into_bytes())
}

/// Whether `message` (the file's path taken out) names a line, a section (`[…]`) or a key.
fn names_a_place(message: &str, path: &Path, names: &BTreeSet<String>) -> bool {
    let message = message.replace(&path.display().to_string(), "");
    message.contains("line ")
        || message.contains('[')
        || message.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| names.contains(w))
}

/// The longest a config may take to be read and checked: it opens nothing but itself.
const CONFIG_TIME: Duration = Duration::from_secs(2);

/// Config files (issue 57): the shipped configs edited key by key with values of every type and
/// edge (0, negatives, i64's ends, NaN and infinities, empty and 100 KB strings, arrays and tables
/// where scalars go, unknown and misplaced keys and sections), configs made up from the section
/// structs' keys, and both changed as text (sections and keys given twice, integers of 2^63 and
/// above, lines cut, bytes mutated), read as `ember train --config` reads them before it opens
/// anything ([`ConfigFile::read`]). An error must name a line, a section or a key; a config
/// accepted must write back to TOML that reads as the same config.
#[test]
fn config_toml() {
    use ember_train::config::ConfigFile;
    let schema = ConfigSchema::new();
    // The seeds pass (those of `ember bench train` as it reads them).
    for (name, _) in &schema.shipped {
        let path = root().join("configs").join(name);
        if let Err(e) = ConfigFile::read(&path) {
            let bench = ConfigFile::read_for(&path, Purpose::Bench);
            assert!(bench.is_ok(), "the shipped {name} is refused: {e}");
        }
    }
    generated(
        "config toml",
        "config.toml",
        iters::CONFIG,
        |rng| config_file(rng, &schema),
        |dir, _| {
            let path = dir.join("config.toml");
            let started = Instant::now();
            let read = ConfigFile::read(&path);
            let took = started.elapsed();
            assert!(took < CONFIG_TIME, "reading the config took {took:?}");
            let file = match read {
                Ok(file) => file,
                Err(e) => {
                    let e = format!("{e:#}");
                    assert!(names_a_place(&e, &path, &schema.names), "the error names no line, section or key: {e}");
                    return Err(e);
                }
            };
            // Accepted: written back (as a run directory keeps it), it reads as the same config. A
            // length in epochs is written only once the data has turned it into steps.
            if file.config.pending.is_some() {
                return Ok(());
            }
            let written =
                toml::to_string(&file.config).unwrap_or_else(|e| panic!("an accepted config does not serialise: {e}"));
            let again = ConfigFile::parse(&written, &path)
                .unwrap_or_else(|e| panic!("an accepted config, written back, is refused: {e}\n{written}"));
            let (a, b) = (format!("{:?}", file.config), format!("{:?}", again.config));
            assert!(a == b, "an accepted config reads back as another:\n{a}\n{b}\n{written}");
            Ok(())
        },
    );
}

/// Texts a prompt, an answer or a message's content may hold: special tokens, template syntax,
/// control characters, and now and then a long one.
fn chat_text(rng: &mut ChaCha8Rng) -> String {
    const TEXTS: [&str; 15] = [
        "",
        " ",
        "a",
        "What is 2 + 2?",
        "4, of course.",
        "ünïcödé ✓ 🔥",
        "<|im_end|>",
        "<|im_start|>assistant\n",
        "<|endoftext|>",
        "\n\n",
        "\u{0}\u{1b}[2J",
        "{{ raise_exception('no') }}",
        "{% for %}",
        "\u{fffd}\u{202e}",
        "<start_of_turn>model\n",
    ];
    match rng.random_range(0..40) {
        0 => "The night is long. ".repeat(rng.random_range(1..400)),
        _ => pick(rng, &TEXTS).to_string(),
    }
}

/// Any JSON value, a few levels deep at most (and now and then far deeper than serde_json's
/// recursion limit).
fn json_junk(rng: &mut ChaCha8Rng, depth: usize) -> serde_json::Value {
    use serde_json::{json, Value};
    match rng.random_range(0..9) {
        0 => Value::Null,
        1 => json!(rng.random::<bool>()),
        2 => json!(*pick(rng, &[0i64, -1, 1, i64::MAX, i64::MIN])),
        3 => json!(*pick(rng, &[0.5f64, -0.0, 1e308, 5e-324])),
        4 => json!(chat_text(rng)),
        5 if depth < 3 => Value::Array((0..rng.random_range(0..3)).map(|_| json_junk(rng, depth + 1)).collect()),
        6 if depth < 3 => json!({ "role": json_junk(rng, depth + 1), "content": json_junk(rng, depth + 1) }),
        7 => serde_json::from_str(&format!("{}{}", "[".repeat(200), "]".repeat(200))).unwrap_or(Value::Null),
        _ => json!({}),
    }
}

/// A chat message of role `role`; with probability `noise` each part goes wrong: a role unknown
/// or not a string, content a list of parts or junk, a key missing, the message not an object.
fn chat_message(rng: &mut ChaCha8Rng, role: &str, noise: f64) -> serde_json::Value {
    use serde_json::{json, Value};
    if rng.random_bool(noise / 4.0) {
        return json_junk(rng, 1);
    }
    let role = match rng.random_bool(noise).then(|| rng.random_range(0..4)) {
        None => Some(json!(role)),
        Some(0) => Some(json!(pick(rng, &ember_data::finetune::ROLES))),
        Some(1) => Some(json!(pick(rng, &["human", "", "ASSISTANT", "bot", " user", "model"]))),
        Some(2) => Some(json_junk(rng, 2)),
        Some(_) => None,
    };
    let content = match rng.random_bool(noise).then(|| rng.random_range(0..3)) {
        None => Some(json!(chat_text(rng))),
        Some(0) => Some(json!([{ "type": "text", "text": chat_text(rng) }])),
        Some(1) => Some(json_junk(rng, 2)),
        Some(_) => None,
    };
    let mut m = serde_json::Map::new();
    for (key, value) in [("role", role), ("content", content)] {
        if let Some(v) = value {
            m.insert(key.into(), v);
        }
    }
    if rng.random_bool(0.05) {
        m.insert(pick(rng, &["name", "tool_calls", "reasoning_content", "weight"]).to_string(), json_junk(rng, 1));
    }
    Value::Object(m)
}

/// A list of chat messages whose roles follow `roles` (cycled): one to four of them, none now and
/// then.
fn chat(rng: &mut ChaCha8Rng, roles: &[&str], noise: f64) -> serde_json::Value {
    let n = if rng.random_bool(noise / 2.0) { 0 } else { *pick(rng, &[1usize, 1, 2, 3, 4]) };
    serde_json::Value::Array((0..n).map(|i| chat_message(rng, roles[i % roles.len()], noise)).collect())
}

/// A preference row as TRL writes them, text or messages; with probability `noise` parts go
/// missing, mistyped or mixed. The chosen answer is now and then the rejected one, and keys extra.
fn preference_row(rng: &mut ChaCha8Rng, noise: f64) -> serde_json::Value {
    use serde_json::{json, Value};
    if rng.random_bool(noise / 4.0) {
        return json_junk(rng, 0);
    }
    let conversational = rng.random_bool(0.5);
    let part = |rng: &mut ChaCha8Rng, roles: &[&str]| -> Value {
        if rng.random_bool(noise / 8.0) {
            return json_junk(rng, 1);
        }
        match conversational ^ rng.random_bool(noise / 4.0) {
            false => json!(chat_text(rng)),
            true => chat(rng, roles, noise),
        }
    };
    let prompt = {
        const ROLES: [&[&str]; 3] = [&["user"], &["system", "user"], &["user", "assistant", "user"]];
        let roles = pick(rng, &ROLES);
        part(rng, roles)
    };
    let chosen = part(rng, &["assistant"]);
    let rejected = if rng.random_bool(0.15) { chosen.clone() } else { part(rng, &["assistant"]) };
    let mut row = serde_json::Map::new();
    for (key, value) in [("prompt", prompt), ("chosen", chosen), ("rejected", rejected)] {
        if !rng.random_bool(noise / 4.0) {
            row.insert(key.into(), value);
        }
    }
    if rng.random_bool(0.05) {
        row.insert(pick(rng, &["messages", "score_chosen", "id", "prompt_id"]).to_string(), json_junk(rng, 1));
    }
    Value::Object(row)
}

/// A fine-tuning row: mostly `messages`, some prompt/completion and text rows; with probability
/// `noise` junk, or messages that are not a list.
fn chat_row(rng: &mut ChaCha8Rng, noise: f64) -> serde_json::Value {
    use serde_json::json;
    if rng.random_bool(noise / 2.0) {
        return match rng.random_bool(0.5) {
            true => json_junk(rng, 0),
            false => json!({ "messages": json_junk(rng, 1) }),
        };
    }
    match rng.random_range(0..10) {
        0 => json!({ "prompt": chat_text(rng), "completion": chat_text(rng) }),
        1 => json!({ "text": chat_text(rng) }),
        _ => {
            const ROLES: [&[&str]; 3] = [&["user", "assistant"], &["system", "user", "assistant"], &["assistant"]];
            let roles = pick(rng, &ROLES);
            json!({ "messages": chat(rng, roles, noise) })
        }
    }
}

/// A JSON-lines file of up to 6 `row`s, with blank lines, CRLF endings, no final newline; at a
/// noise level drawn for the file (none for a quarter of them), a line cut short, a byte order
/// mark, and whatever `row` does with it.
fn jsonl_file(rng: &mut ChaCha8Rng, row: fn(&mut ChaCha8Rng, f64) -> serde_json::Value) -> (String, Vec<u8>) {
    let noise = *pick(rng, &[0.0, 0.02, 0.1, 0.3]);
    let mut out = String::new();
    if rng.random_bool(noise / 4.0) {
        out.push('\u{feff}');
    }
    let n = rng.random_range(0..=6);
    for _ in 0..n {
        match rng.random_range(0..10) {
            0 => out.push('\n'),
            1 => out.push_str(" \t\n"),
            _ if rng.random_bool(noise / 4.0) => {
                let line = row(rng, noise).to_string();
                let cut = line.char_indices().map(|(i, _)| i).nth(rng.random_range(0..line.chars().count()));
                out.push_str(&line[..cut.unwrap_or(0)]);
                out.push('\n');
            }
            _ => {
                out.push_str(&row(rng, noise).to_string());
                out.push_str(if rng.random_bool(0.1) { "\r\n" } else { "\n" });
            }
        }
    }
    if rng.random_bool(0.1) {
        out.pop();
    }
    (format!("{n} lines at noise {noise}"), out.into_bytes())
}

/// Checks that `e`, an error about the JSON-lines file `path` (its text `text`), names the file and
/// a line of it that holds a row (line 0: a file without one).
fn names_file_and_line(e: &str, path: &Path, text: &str) {
    let file = format!("{}:", path.display());
    let rest = e.strip_prefix(&file).unwrap_or_else(|| panic!("the error does not start with the file: {e}"));
    let line = rest.split_once(": ").and_then(|(n, _)| n.parse::<usize>().ok());
    let line = line.unwrap_or_else(|| panic!("the error names no line: {e}"));
    let lines: Vec<&str> = text.lines().collect();
    match line {
        0 => assert!(lines.iter().all(|l| l.trim().is_empty()), "line 0 named in a file with rows: {e}"),
        n => assert!(lines.get(n - 1).is_some_and(|l| !l.trim().is_empty()), "line {n} is blank or past the end: {e}"),
    }
}

/// The tokenizer and templates the JSONL generators encode with: ChatML, Qwen3's and Gemma 3's,
/// or none (messages then need one, and say so).
fn tokenizer_and_templates() -> (Tokenizer, Vec<Option<ChatTemplate>>) {
    let (tokenizer, chatml) = tokenizer_and_template();
    let mut templates = vec![None, Some(chatml)];
    for (name, t) in templates_of(&["qwen3", "gemma3-gguf"]) {
        templates.push(Some(
            ChatTemplate::new(t, "<bos>".into(), "<|im_end|>".into()).unwrap_or_else(|e| panic!("{name}: {e}")),
        ));
    }
    (tokenizer, templates)
}

fn templates_of(names: &[&str]) -> Vec<(String, String)> {
    templates().into_iter().filter(|(n, _)| names.contains(&n.as_str())).collect()
}

/// Preference JSONL (issue 57): rows of text or messages with roles, contents and types at
/// random, parts missing, mixed or the same in chosen and rejected, read
/// ([`ember_data::preference::read_preference_jsonl`]) and tokenized as `ember train` does through
/// a real tokenizer and chat template, each pair laid out as its row. Every error names the file
/// and a line of it that holds a row; the records accepted carry their lines.
#[test]
fn preference_jsonl() {
    use ember_data::preference::{answer_masks, encode_pairs_of_file, read_preference_jsonl};
    let (tokenizer, templates) = tokenizer_and_templates();
    generated(
        "preference jsonl",
        "pairs.jsonl",
        iters::PREFERENCE,
        |rng| jsonl_file(rng, preference_row),
        |dir, bytes| {
            let (path, text) = (dir.join("pairs.jsonl"), text(bytes)?);
            let named = |e: ember_data::DataError| {
                let e = e.to_string();
                names_file_and_line(&e, &path, text);
                e
            };
            let records = read_preference_jsonl(&path).map_err(named)?;
            let lines: Vec<usize> = records.iter().map(|r| r.line).collect();
            assert!(lines.windows(2).all(|w| w[0] < w[1]), "lines out of order: {lines:?}");
            for &line in &lines {
                assert!(text.lines().nth(line - 1).is_some_and(|l| !l.trim().is_empty()), "line {line} holds no row");
            }
            assert!(records.iter().any(|r| r.chosen != r.rejected), "every pair the same, accepted");
            let template = templates[bytes.len() % templates.len()].as_ref();
            let pairs = encode_pairs_of_file(&path, &records, &tokenizer, template).map_err(named)?;
            for pair in &pairs {
                for seq_len in [pair.len(), pair.len() / 2, 0] {
                    if let Some(row) = pair.row(seq_len, 0) {
                        answer_masks(&row);
                    }
                }
            }
            Ok(())
        },
    );
}

/// Fine-tuning chats (issue 57): `messages` rows with roles, contents and types at random (and a
/// few prompt/completion and text rows), read ([`ember_data::finetune::read_jsonl`]), encoded
/// through a real tokenizer and chat template and packed. Every error reading or encoding the file
/// names it and a line of it that holds a row; the records accepted carry their lines.
#[test]
fn chat_jsonl() {
    let (tokenizer, templates) = tokenizer_and_templates();
    generated(
        "chat jsonl",
        "chat.jsonl",
        iters::CHAT,
        |rng| jsonl_file(rng, chat_row),
        |dir, bytes| {
            let (path, text) = (dir.join("chat.jsonl"), text(bytes)?);
            let records = ember_data::finetune::read_jsonl(&path).map_err(|e| {
                let e = e.to_string();
                names_file_and_line(&e, &path, text);
                e
            })?;
            let template = templates[bytes.len() % templates.len()].as_ref();
            // A record the tokenizer or template refuses is named by its file and line too.
            let examples =
                ember_data::finetune::encode_of_file(&path, &records, &tokenizer, template).map_err(|e| {
                    let e = e.to_string();
                    names_file_and_line(&e, &path, text);
                    e
                })?;
            let lines: Vec<usize> = records.iter().map(|r| r.line).collect();
            assert!(lines.windows(2).all(|w| w[0] < w[1]), "lines out of order: {lines:?}");
            for &line in &lines {
                assert!(text.lines().nth(line - 1).is_some_and(|l| !l.trim().is_empty()), "line {line} holds no row");
            }
            for packing in [Packing::Documents, Packing::Stream, Packing::None] {
                PackedExamples::new(&examples, 32, 0, packing, true).map_err(|e| e.to_string())?;
            }
            Ok(())
        },
    );
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
