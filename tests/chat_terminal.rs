//! `ember chat` in a real pseudo-terminal, typed at as a person would, on a real chat model
//! (SmolLM2-135M-Instruct, imported from the shared GGUF): the prompt marker and the coloured
//! answer, Ctrl-C during an answer stops the answer and keeps the session, `/reset`, `/system`,
//! history (the up arrow recalls the previous line), `/save` writes JSONL of the fine-tuning chat
//! format, Ctrl-C on a line clears it and at an empty prompt ends the session. And the same
//! binary with stdin a pipe: answers alone, no marker, no colour.
//! (issue 38: "no prompt marker, arrow keys print `^[[D`, Ctrl-C ends the whole session")

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use common::Scratch;
use serde_json::Value;

/// The answer's colour (cyan) and the end of it: what `ember chat` writes around the model's words.
const ANSWER: &str = "\x1b[36m";
const PLAIN: &str = "\x1b[0m";
const MARKER: &str = "> ";
const QUESTION: &str = "What is 2 + 2?";

/// `ember` on the slave side of a pseudo-terminal (its controlling terminal, as in a shell), read
/// and typed at through the master side.
struct Terminal {
    child: Child,
    master: File,
    chunks: Receiver<Vec<u8>>,
    /// All the output so far (escape codes included).
    seen: String,
    /// Where the next [`Terminal::expect`] starts looking.
    mark: usize,
    log: PathBuf,
}

impl Terminal {
    fn start(s: &Scratch, args: &[&str]) -> Self {
        let (mut master, mut slave) = (-1, -1);
        let size = libc::winsize { ws_row: 40, ws_col: 200, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: openpty writes the two descriptors; the name and termios pointers may be null.
        let rc = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &size) };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors were just opened and are owned here alone.
        let (master, slave) = unsafe { (File::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let log = s.path().join("chat.log");
        let mut cmd = s.command(args);
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            // The log apart, so that the terminal shows what a user sees.
            .stderr(File::create(&log).unwrap())
            .env("TERM", "xterm-256color")
            .env_remove("NO_COLOR");
        // SAFETY: only async-signal-safe calls between fork and exec: a new session whose
        // controlling terminal is the pty on stdin, so that Ctrl-C there is SIGINT to ember.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start ember chat");
        drop(slave);
        let (tx, chunks) = mpsc::channel();
        let mut reader = master.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends with an error (EIO) once the child has closed the terminal.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Self { child, master, chunks, seen: String::new(), mark: 0, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the output after the mark holds `needle`; moves the mark past it and returns
    /// what came before it.
    fn expect(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(at) = self.seen[self.mark..].find(needle) {
                let before = self.seen[self.mark..self.mark + at].to_string();
                self.mark += at + needle.len();
                return before;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.chunks.recv_timeout(left) {
                Ok(chunk) => self.seen.push_str(&String::from_utf8_lossy(&chunk)),
                Err(_) => panic!(
                    "no {needle:?} within {timeout:?}; after the mark: {:?}\nlog:\n{}",
                    &self.seen[self.mark..],
                    self.log()
                ),
            }
        }
    }

    /// Waits until at least `n` bytes have come after the mark (without moving it).
    fn expect_bytes(&mut self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.seen.len() - self.mark < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.chunks.recv_timeout(left) {
                Ok(chunk) => self.seen.push_str(&String::from_utf8_lossy(&chunk)),
                Err(_) => panic!("fewer than {n} bytes within {timeout:?}: {:?}", &self.seen[self.mark..]),
            }
        }
    }

    fn type_keys(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).unwrap();
        self.master.flush().unwrap();
    }

    /// Types `line` and Enter, then waits for the whole answer and the next prompt; the answer's text.
    fn ask(&mut self, line: &str) -> String {
        self.type_keys(&format!("{line}\r"));
        self.expect(ANSWER, Duration::from_secs(60));
        let answer = self.expect(PLAIN, Duration::from_secs(120));
        self.expect(MARKER, Duration::from_secs(10));
        // The terminal shows a newline as CR LF.
        answer.replace("\r\n", "\n").trim().to_string()
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn chat_in_a_terminal_keeps_its_session_through_ctrl_c_and_recalls_history() {
    let s = Scratch::new();
    let run = common::import_smollm2(&s);
    let run = run.to_str().unwrap();
    let mut t = Terminal::start(&s, &["chat", "--checkpoint", run, "--seed", "7", "--max-new-tokens", "300"]);
    let greeting = t.expect(MARKER, Duration::from_secs(60));
    assert!(greeting.contains("chatting with") && greeting.contains("temperature 0.2, top-p 0.9"), "{greeting:?}");
    assert!(t.seen.contains("\x1b[1;32m> "), "the prompt marker in colour: {:?}", t.seen);

    // Ctrl-C while the answer streams: the answer stops, the session goes on.
    t.type_keys("Write a long story about a dragon who learns to fly.\r");
    t.expect(ANSWER, Duration::from_secs(60));
    t.expect_bytes(30, Duration::from_secs(60));
    t.type_keys("\x03");
    let cut = t.expect("(stopped)", Duration::from_secs(30));
    assert!(cut.trim().len() >= 20, "part of the story came before the stop: {cut:?}");
    t.expect(MARKER, Duration::from_secs(10));
    assert!(t.child.try_wait().unwrap().is_none(), "Ctrl-C during an answer ended the session:\n{}", t.log());

    t.type_keys("/reset\r");
    t.expect("(conversation cleared)", Duration::from_secs(10));
    t.expect(MARKER, Duration::from_secs(10));
    t.type_keys("/system Answer in one short sentence.\r");
    t.expect("(system prompt set", Duration::from_secs(10));
    t.expect(MARKER, Duration::from_secs(10));
    let first = t.ask(QUESTION);
    assert!(!first.is_empty(), "an answer after the stopped one");

    // The up arrow brings back the question (redrawn on the prompt line); Enter sends it again.
    t.type_keys("\x1b[A");
    t.expect(QUESTION, Duration::from_secs(10));
    let second = t.ask("");
    assert!(!second.is_empty(), "an answer to the recalled question");

    t.type_keys("/save saved.jsonl\r");
    t.expect("(appended the conversation (5 messages) to saved.jsonl)", Duration::from_secs(10));
    t.expect(MARKER, Duration::from_secs(10));
    let saved = std::fs::read_to_string(s.path().join("saved.jsonl")).expect("/save wrote the file");
    let lines: Vec<&str> = saved.lines().collect();
    assert_eq!(lines.len(), 1, "{saved}");
    let chat: Value = serde_json::from_str(lines[0]).expect("a JSON line");
    let messages = chat["messages"].as_array().expect("messages");
    let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"], "the reset dropped the story: {saved}");
    assert_eq!(messages[0]["content"], "Answer in one short sentence.");
    assert_eq!((messages[1]["content"].as_str(), messages[3]["content"].as_str()), (Some(QUESTION), Some(QUESTION)));
    assert_eq!(messages[2]["content"].as_str().map(str::trim), Some(first.as_str()), "saved as shown");

    // Ctrl-C on a typed line clears it; Ctrl-C at the empty prompt ends the session, cleanly.
    t.type_keys("never sent");
    t.expect("never sent", Duration::from_secs(10));
    t.type_keys("\x03");
    std::thread::sleep(Duration::from_millis(300));
    assert!(t.child.try_wait().unwrap().is_none(), "Ctrl-C on a line with text ended the session");
    t.type_keys("\x03");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = t.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "Ctrl-C at the empty prompt did not end the session");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}\n{}", t.log());
    assert!(!t.seen.contains("^[["), "escape codes echoed as text: {:?}", t.seen);

    // The model's own defaults: a generation_config.json (as `ember import` keeps from a Hugging
    // Face folder) of top-k 1, which samples greedily whatever the seed, for the chat and for
    // `sample --chat` alike; `sample --chat` with two prompts puts each answer under its prompt.
    let config = r#"{"do_sample": true, "temperature": 0.7, "top_k": 1, "eos_token_id": 2}"#;
    std::fs::write(s.path().join("smol/checkpoints/step-000000/generation_config.json"), config).unwrap();
    let out = s.ember(&[
        "sample",
        "--checkpoint",
        run,
        "--chat",
        "--max-new-tokens",
        "16",
        "--prompt",
        QUESTION,
        "--prompt",
        QUESTION,
    ]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(common::stderr(&out).contains("sampling: temperature 0.7, top-k 1"), "{}", common::stderr(&out));
    let batch = common::stdout(&out);
    let greedy = batch
        .strip_prefix(&format!("=== 0 ===\n{QUESTION}\n"))
        .and_then(|rest| rest.split_once(&format!("\n=== 1 ===\n{QUESTION}\n")))
        .map(|(first, second)| (first.to_string(), second.to_string()))
        .unwrap_or_else(|| panic!("each answer on the line after its prompt: {batch:?}"));
    assert_eq!(format!("{}\n", greedy.0), greedy.1, "two greedy answers alike: {batch:?}");
    let greedy = greedy.0;
    assert!(!greedy.trim().is_empty());

    // Piped (a script): the answers alone, without marker or colour; the commands still work.
    let mut piped = s
        .command(&["chat", "--checkpoint", run, "--max-new-tokens", "16"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let script = format!("{QUESTION}\n/save piped.jsonl\n");
    piped.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let out = piped.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", common::stderr(&out));
    let log = common::stderr(&out);
    assert!(log.contains("temperature 0.7, top-k 1 (from ") && log.contains("generation_config.json)"), "{log}");
    let text = common::stdout(&out);
    assert!(!text.contains('\x1b') && !text.starts_with(MARKER), "{text:?}");
    assert!(text.contains("(appended the conversation (2 messages) to piped.jsonl)"), "{text:?}");
    // The answer, then the note; greedy, as `sample --chat`'s.
    let (answer, _) = text.split_once("(appended").unwrap();
    assert_eq!(answer, format!("{greedy}\n"), "{text:?}");
    let saved = std::fs::read_to_string(s.path().join("piped.jsonl")).unwrap();
    let saved: Value = serde_json::from_str(saved.trim()).unwrap();
    assert_eq!(saved["messages"][1]["content"].as_str(), Some(greedy.as_str()), "{text:?}");
}
