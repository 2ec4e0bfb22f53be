//! The README's recipes, run as written, and its command reference kept equal to the CLI.
//!
//! Recipes: every fenced block of README.md whose info string carries `test` runs, in README order,
//! in one scratch folder that sees the repository's `configs/`, `examples/` and `datasets/`, with the
//! `ember` cargo built first on `PATH`, under `bash -euo pipefail`. The few liberties, all here:
//! - a line running `ember train` gets `--max-steps 2` appended (a recipe's own count is for a real
//!   run; two steps show that it runs);
//! - the model file the README downloads (from PyPI, into `models/`) is taken from the shared test
//!   assets instead (no network in tests), linked at the path the README's `ember import` reads;
//! - `sh test-server` blocks are started in the background, the next blocks run once the server
//!   answers on the block's `--port`, and it is stopped (SIGTERM) at the end;
//! - stdin carries one question and then ends (what `ember chat` reads);
//! - Open MPI is allowed to run as root and to oversubscribe through its environment variables.
//!
//! A ```toml block with `file=PATH` in its info string shows the repository's file PATH and must be
//! equal to it. The command reference (docs/commands.md) is every command's `--help`; with
//! `EMBER_BLESS=1` the test writes it instead of comparing.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Scratch;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

fn ember_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ember"))
}

/// One fenced block: its info string's words and its text.
struct Block {
    info: Vec<String>,
    text: String,
    line: usize,
}

fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(Vec<String>, String, usize)> = None;
    for (i, line) in markdown.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => {
                open = Some((info.split_whitespace().map(String::from).collect(), String::new(), i + 1))
            }
            (Some(_), Some(rest)) if rest.trim().is_empty() => {
                let (info, text, line) = open.take().expect("open block");
                out.push(Block { info, text, line });
            }
            (Some((_, text, _)), _) => {
                text.push_str(line);
                text.push('\n');
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "README.md: a fenced block is never closed");
    out
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).expect("read README.md")
}

#[test]
fn the_readme_shows_the_repositorys_files_as_they_are() {
    let mut shown = 0;
    for b in blocks(&readme()) {
        for word in &b.info {
            if let Some(file) = word.strip_prefix("file=") {
                let real = std::fs::read_to_string(root().join(file))
                    .unwrap_or_else(|e| panic!("README.md line {}: file={file}: {e}", b.line));
                assert_eq!(b.text, real, "README.md line {}: the block differs from {file}", b.line);
                shown += 1;
            }
        }
    }
    assert!(shown >= 1, "the README shows no recipe file (```toml file=configs/...)");
}

/// The port a `--port N` names in `text`.
fn port_of(text: &str) -> Option<u16> {
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "--port" {
            return words.next()?.parse().ok();
        }
    }
    None
}

fn bash(s: &Scratch, script: &str, path: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.args(["-euo", "pipefail", "-c", script])
        .current_dir(s.path())
        .env("PATH", path)
        .env("EMBER_CACHE_DIR", s.path().join("cache"))
        .env("EMBER_DATA_DIR", root().join("datasets"))
        .env("NO_COLOR", "1")
        .env("RAYON_NUM_THREADS", "2")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    cmd
}

/// Stops a background server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: a signal to a process this test started.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_readme_recipe_runs_as_written() {
    let s = Scratch::new();
    for dir in ["configs", "examples", "datasets"] {
        std::os::unix::fs::symlink(root().join(dir), s.path().join(dir)).expect("link a repository folder");
    }
    let all = blocks(&readme());
    // The model the README downloads, from the shared assets, where the README's recipe imports it.
    let model = common::assets().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let name = model.file_name().and_then(|n| n.to_str()).expect("model file name");
    let imported = all
        .iter()
        .filter(|b| b.info.iter().any(|w| w.starts_with("test")))
        .flat_map(|b| b.text.lines())
        .find_map(|l| l.trim().strip_prefix("ember import ")?.split_whitespace().next().filter(|p| p.ends_with(name)))
        .unwrap_or_else(|| panic!("no README recipe runs `ember import .../{name}`: update this test's stand-in"));
    assert!(
        all.iter().any(|b| !b.info.iter().any(|w| w.starts_with("test")) && b.text.contains(imported)),
        "the README's download block does not leave the model at {imported}, where its recipe imports it"
    );
    let link = s.path().join(imported);
    std::fs::create_dir_all(link.parent().expect("the model's folder")).expect("create the model's folder");
    std::os::unix::fs::symlink(&model, &link).expect("link the model");

    let bin_dir = ember_bin().parent().expect("binary folder").to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut servers = Vec::new();
    let mut ran = 0;
    for b in &all {
        let Some(kind) = b.info.iter().find(|w| w.starts_with("test")) else { continue };
        if b.text.contains("mpirun") && !cfg!(feature = "mpi") {
            eprintln!("README.md line {}: needs a binary built with --features mpi; not run here", b.line);
            continue;
        }
        let script: String = b
            .text
            .lines()
            .map(|l| match l.contains("ember train") {
                // Before a trailing comment, if any.
                true => match l.split_once(" #") {
                    Some((cmd, comment)) => format!("{cmd} --max-steps 2 #{comment}\n"),
                    None => format!("{l} --max-steps 2\n"),
                },
                false => format!("{l}\n"),
            })
            .collect();
        eprintln!("README.md line {}:\n{script}", b.line);
        if kind == "test-server" {
            let port = port_of(&script)
                .unwrap_or_else(|| panic!("README.md line {}: a server block names its --port", b.line));
            let child = bash(&s, &script, &path).stdin(Stdio::null()).spawn().expect("start bash");
            servers.push(Server(child));
            let deadline = Instant::now() + Duration::from_secs(120);
            while TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(Instant::now() < deadline, "README.md line {}: nothing listens on {port}", b.line);
                if let Some(Server(c)) = servers.last_mut() {
                    assert!(c.try_wait().ok().flatten().is_none(), "README.md line {}: the server ended", b.line);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        } else {
            let mut child = bash(&s, &script, &path)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start bash");
            let mut stdin = child.stdin.take().expect("stdin");
            // A closed pipe only means the block reads no input.
            let _ = stdin.write_all(b"What is the capital of France?\n");
            drop(stdin);
            let out = child.wait_with_output().expect("run the block");
            let (stdout, stderr) = (common::stdout(&out), common::stderr(&out));
            assert!(out.status.success(), "README.md line {}:\n{script}\nstdout:\n{stdout}\nstderr:\n{stderr}", b.line);
            assert!(!stderr.contains("panicked"), "README.md line {}: {stderr}", b.line);
        }
        ran += 1;
    }
    assert!(ran >= 5, "only {ran} README blocks are tested");
    drop(servers);
}

/// `ember --help` and every command's, as docs/commands.md shows them.
fn command_reference() -> String {
    let help = |args: &[&str]| {
        let out = Command::new(ember_bin()).args(args).env("NO_COLOR", "1").output().expect("run ember --help");
        assert!(out.status.success(), "ember {args:?}: {}", common::stderr(&out));
        common::stdout(&out)
    };
    let top = help(&["--help"]);
    // clap lists the commands between "Commands:" and the next blank line.
    let commands: Vec<String> = top
        .split("Commands:\n")
        .nth(1)
        .expect("ember --help lists its commands")
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .filter(|c| c != "help")
        .collect();
    let mut doc = String::from(
        "# ember's commands\n\nEvery command's `--help`, as the binary prints it (tests/readme.rs keeps this file equal to \
         it; `EMBER_BLESS=1 cargo test --release --test readme` rewrites it).\n\n```text\n$ ember --help\n",
    );
    doc.push_str(&top);
    doc.push_str("```\n");
    for c in &commands {
        doc.push_str(&format!("\n## ember {c}\n\n```text\n$ ember {c} --help\n"));
        doc.push_str(&help(&[c, "--help"]));
        doc.push_str("```\n");
    }
    doc
}

#[test]
fn the_command_reference_is_the_clis_own() {
    let path = root().join("docs/commands.md");
    let made = command_reference();
    if std::env::var_os("EMBER_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().expect("docs folder")).expect("create docs/");
        std::fs::write(&path, &made).expect("write docs/commands.md");
        return;
    }
    let kept = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        kept == made,
        "docs/commands.md is not the CLI's --help (a flag changed?): run `EMBER_BLESS=1 cargo test --release --test readme` \
         and commit it"
    );
}
